#!/usr/bin/env bash
# Generates the certificates the security tests use, with the openssl CLI
# (Debian package openssl), into DIR:
#   ca.pem/ca.key            the cluster CA
#   coordinator.{pem,key}    SAN IP:127.0.0.1, DNS:localhost, URI:baton://role/coordinator
#   worker.{pem,key}         URI:baton://role/worker
#   operator.{pem,key}       URI:baton://role/operator
#   norole.{pem,key}         a valid certificate with no baton role
#   expired.{pem,key}        role worker, expired yesterday
#   impostor.{pem,key}       role worker, but naming 127.0.0.1 (a worker posing as the coordinator)
#   other_ca.pem             another CA, and other_worker.{pem,key} and
#                            other_coordinator.{pem,key} signed by it
# The same commands make real deployments' certificates (docs/security.md).
set -euo pipefail
dir=${1:?usage: gen_certs.sh DIR}
mkdir -p "$dir"
cd "$dir"

ca() {  # name
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -out "$1.pem" \
    -days 30 -subj "/CN=baton $1" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

leaf() {  # name ca san days
  local name=$1 issuer=$2 san=$3 days=$4
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$name.key" -out "$name.csr" \
    -subj "/CN=$name" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=serverAuth,clientAuth"
    [ -n "$san" ] && echo "subjectAltName=$san"
  } > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA "$issuer.pem" -CAkey "$issuer.key" -CAcreateserial -out "$name.pem" \
    -days "$days" -extfile "$name.ext" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
  chmod 600 "$name.key"
}

ca ca
ca other_ca
leaf coordinator ca "IP:127.0.0.1,DNS:localhost,URI:baton://role/coordinator" 30
leaf worker ca "URI:baton://role/worker" 30
leaf operator ca "URI:baton://role/operator" 30
leaf norole ca "" 30
leaf expired ca "URI:baton://role/worker" -1
leaf other_worker other_ca "URI:baton://role/worker" 30
leaf impostor ca "IP:127.0.0.1,DNS:localhost,URI:baton://role/worker" 30
leaf other_coordinator other_ca "IP:127.0.0.1,DNS:localhost,URI:baton://role/coordinator" 30
openssl rand -hex 32 > token
openssl rand -hex 32 > wrong_token
chmod 600 token wrong_token
