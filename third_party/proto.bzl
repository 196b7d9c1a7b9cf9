"""baton_cc_proto: C++ (and gRPC) code from .proto files via the system protoc.

Debian's protoc 3.21 and grpc_cpp_plugin 1.51 generate the code in a genrule;
no Bazel proto rules (which would need downloads) are involved. Import paths
are relative to the package that holds the protos (for //proto: "baton/v1/x.proto").
"""

def baton_cc_proto(name, srcs, grpc_srcs = [], deps = [], visibility = None):
    """srcs: all .proto files; grpc_srcs: the subset that declares services."""
    pkg = native.package_name()
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc"]
    for src in grpc_srcs:
        base = src[:-len(".proto")]
        outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    grpc_cmd = ""
    if grpc_srcs:
        grpc_cmd = (" && protoc -I{pkg} --grpc_out=$(GENDIR)/{pkg} " +
                    "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin) " +
                    " ".join(["$(location %s)" % s for s in grpc_srcs])).format(pkg = pkg)
    native.genrule(
        name = name + "_gen",
        srcs = srcs,
        outs = outs,
        cmd = ("protoc -I{pkg} --cpp_out=$(GENDIR)/{pkg} " +
               " ".join(["$(location %s)" % s for s in srcs])).format(pkg = pkg) + grpc_cmd,
        message = "protoc " + name,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        includes = ["."],
        copts = ["-w"],  # generated code; our own code builds with -Wall -Wextra
        deps = deps + ["//third_party:grpc", "//third_party:protobuf"],
        visibility = visibility,
    )
