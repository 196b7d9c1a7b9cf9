#!/usr/bin/env python3
"""Tokenizes text files into llm.c shards that baton reads as token_format "llmc".

  python3 scripts/tokenize.py --input docs/*.md README.md --out_dir data/corpus \
      [--name corpus] [--val_fraction 0.01] [--encoding gpt2|bytes] [--shard_size 100000000]

writes OUT_DIR/NAME_train_000000.bin, ... and, when --val_fraction > 0,
OUT_DIR/NAME_val_000000.bin, ...: llm.c's format (dev/data/data_common.py),
256 little-endian int32 header words -- [0] magic 20240520, [1] version 1,
[2] token count -- then the ids as little-endian uint16 (docs/data.md
"Token files", worker/data/token_shards.cc). A job reads them with

  data { tokens_file: "OUT_DIR/NAME_train_*.bin" token_format: "llmc" }
  train { eval_every_steps: ... eval_data { tokens_file: "OUT_DIR/NAME_val_*.bin" token_format: "llmc" } }

(paths relative to the workers' --data_dir; batonctl local uses the job
file's directory).

Encodings:
  gpt2   tiktoken's GPT-2 BPE (`pip install tiktoken`), ids < 50257. As llm.c
         does, every document (here: every input file) starts with
         <|endoftext|> (50256) and is encoded with encode_ordinary (special
         tokens in the text are plain text). tiktoken fetches its BPE files
         from the internet on first use and caches them under
         $TIKTOKEN_CACHE_DIR (default: a tiktoken-cache folder in the temp
         directory); on a machine without that access, copy a filled cache
         there from one that has it.
  bytes  id = byte value (0..255), no document separator: fully offline, for
         smoke tests and timing (any model.vocab >= 256 reads it).

The held-out split is the last --val_fraction of the token stream (not
shuffled, cut at a token, not a document); training data is the rest. Each
shard must hold at least model.seq_len + 1 ids for baton to read it: the
script warns about shards shorter than --warn_below ids. The whole corpus is
held in memory as uint16 (2 bytes a token): fine up to a few hundred million
tokens; shard larger corpora in several runs with different --name.
"""

import argparse
import array
import os
import struct
import sys

LLMC_MAGIC_GPT2 = 20240520
LLMC_VERSION_UINT16 = 1
HEADER_WORDS = 256


class BytesEncoder:
    """id = byte value: offline, vocab 256, no end-of-document token."""

    vocab = 256
    eot = None

    def encode_document(self, text_bytes):
        # Through a "B" array: array("H", some_bytes) would read the bytes as uint16 pairs.
        return array.array("H", array.array("B", text_bytes))


class TiktokenEncoder:
    """tiktoken's GPT-2 encoding, <|endoftext|> before each document (as llm.c)."""

    def __init__(self, name):
        try:
            import tiktoken
        except ImportError:
            sys.exit("scripts/tokenize.py: --encoding %s needs tiktoken: `pip install tiktoken` "
                     "(or --encoding bytes for an offline byte-level smoke test)" % name)
        try:
            self._enc = tiktoken.get_encoding(name)
        except Exception as e:  # tiktoken raises requests' errors when it cannot download
            sys.exit("scripts/tokenize.py: tiktoken could not load encoding %r: %s\n"
                     "tiktoken downloads its BPE files on first use; on a machine without internet "
                     "access, copy a filled cache into $TIKTOKEN_CACHE_DIR, or use --encoding bytes"
                     % (name, e))
        self.vocab = self._enc.n_vocab
        self.eot = self._enc.eot_token
        if self.vocab > 1 << 16:
            sys.exit("scripts/tokenize.py: encoding %r has %d ids; llm.c's GPT-2 shards hold uint16 "
                     "ids (at most 65536)" % (name, self.vocab))

    def encode_document(self, text_bytes):
        ids = array.array("H", [self.eot])
        ids.extend(self._enc.encode_ordinary(text_bytes.decode("utf-8", errors="replace")))
        return ids


def write_shard(path, ids):
    """Writes one llm.c shard atomically (baton maps shards: never rewrite one in place)."""
    header = [0] * HEADER_WORDS
    header[0] = LLMC_MAGIC_GPT2
    header[1] = LLMC_VERSION_UINT16
    header[2] = len(ids)
    if sys.byteorder != "little":
        ids = array.array("H", ids)
        ids.byteswap()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<%di" % HEADER_WORDS, *header))
        f.write(ids.tobytes())
    os.replace(tmp, path)


def write_split(out_dir, name, split, ids, shard_size, warn_below):
    paths = []
    for i, begin in enumerate(range(0, len(ids), shard_size)):
        shard = ids[begin:begin + shard_size]
        path = os.path.join(out_dir, "%s_%s_%06d.bin" % (name, split, i))
        write_shard(path, shard)
        if len(shard) < warn_below:
            print("warning: %s holds %d ids; a job reads only shards of at least model.seq_len + 1 ids"
                  % (path, len(shard)), file=sys.stderr)
        paths.append(path)
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text files; each is one document")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--name", default="corpus", help="shard names: NAME_train_000000.bin, NAME_val_000000.bin")
    p.add_argument("--val_fraction", type=float, default=0.01,
                   help="the last fraction of the tokens goes to the val shards (0: no val split)")
    p.add_argument("--encoding", default="gpt2", help="a tiktoken encoding (gpt2), or bytes")
    p.add_argument("--shard_size", type=int, default=100_000_000, help="ids per shard (llm.c: 1e8)")
    p.add_argument("--warn_below", type=int, default=1025, help="warn about shards with fewer ids")
    args = p.parse_args(argv)
    if not 0.0 <= args.val_fraction < 1.0:
        p.error("--val_fraction is %g; give a value in [0, 1)" % args.val_fraction)
    if args.shard_size < 1:
        p.error("--shard_size must be >= 1")

    enc = BytesEncoder() if args.encoding == "bytes" else TiktokenEncoder(args.encoding)
    ids = array.array("H")
    for path in args.input:
        with open(path, "rb") as f:
            ids.extend(enc.encode_document(f.read()))
    if not ids:
        sys.exit("scripts/tokenize.py: the inputs hold no text")

    n_val = int(round(len(ids) * args.val_fraction))
    if args.val_fraction > 0 and n_val == 0:
        n_val = 1
    train, val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]
    os.makedirs(args.out_dir, exist_ok=True)
    written = write_split(args.out_dir, args.name, "train", train, args.shard_size, args.warn_below)
    if n_val:
        written += write_split(args.out_dir, args.name, "val", val, args.shard_size, args.warn_below)
    print("%s: %d documents, %d ids (%d train, %d val), vocab %d, max id %d -> %s"
          % (args.encoding, len(args.input), len(ids), len(train), len(val), enc.vocab, max(ids),
             ", ".join(written)))


if __name__ == "__main__":
    main()
