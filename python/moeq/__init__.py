"""moeq from Python: quantize MoE (and dense) LLMs with GPTQ or round to nearest into NVFP4 and
INT4, evaluate them exactly as lm-evaluation-harness does, inspect checkpoints.

    import moeq
    r = moeq.quantize("allenai/OLMoE-1B-7B-0924", "olmoe-nvfp4", scheme="nvfp4a16",
                      method="gptq", calib="calib.txt", nsamples=128,
                      progress=lambda label, done, total: print(done, total))
    e = moeq.evaluate("olmoe-nvfp4", "wikitext2_test.txt", kl_base="allenai/OLMoE-1B-7B-0924")
    print(e["word_perplexity"], e["kl_mean"])

Keyword options are `moeq quantize`'s and `moeq eval`'s flags with underscores for dashes
(act_order=True, max_memory="6GB", report_html="report.html"). Errors raise moeq.Error with
the library's message; Ctrl-C stops a long call cleanly (KeyboardInterrupt, nothing left
behind). The package is ctypes over libmoeq.so and has no other dependencies.
"""

from ._core import Error, evaluate, inspect, quantize, version

__all__ = ["Error", "evaluate", "inspect", "quantize", "version"]
