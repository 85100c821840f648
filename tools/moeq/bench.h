/* Benchmarks behind `moeq bench <name>`; each takes argv with argv[0] = its own name. */
#ifndef MOEQ_BENCH_H
#define MOEQ_BENCH_H
int bench_eval(int argc, char **argv);
int bench_forward(int argc, char **argv);
int bench_gen_model(int argc, char **argv);
int bench_gptq(int argc, char **argv);
int bench_quantize(int argc, char **argv);
int bench_moe_ffn(int argc, char **argv);
int bench_tokenizer(int argc, char **argv);
#endif
