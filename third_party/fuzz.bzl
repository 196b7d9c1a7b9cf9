"""baton_fuzz_test: a libFuzzer target that is also a plain test.

Under --config=fuzz (clang, -fsanitize=fuzzer) the binary is a libFuzzer
fuzzer; scripts/fuzz.sh runs it for a bounded time on its seed corpus.
Otherwise it links fuzz_replay_main and, as a cc_test, feeds every file of
the seed corpus to LLVMFuzzerTestOneInput once: the corpus (and every crash
input added to it) stays a regression test in every build.
"""

def baton_fuzz_test(name, srcs, deps = [], corpus = None, **kwargs):
    corpus = corpus or (name + "_corpus")
    native.cc_test(
        name = name,
        srcs = srcs,
        deps = deps + select({
            "//third_party:fuzzing": [],
            "//conditions:default": ["//third_party:fuzz_replay_main"],
        }),
        linkopts = select({
            "//third_party:fuzzing": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        data = native.glob([corpus + "/**"]),
        args = ["$(rootpath %s)" % f for f in native.glob([corpus + "/**"])],
        tags = kwargs.pop("tags", []) + ["fuzz"],
        size = kwargs.pop("size", "small"),
        **kwargs
    )
