/* The subcommands; each takes argv with argv[0] = its own name. */
#ifndef MOEQ_COMMANDS_H
#define MOEQ_COMMANDS_H
int cmd_inspect(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_quantize(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_export_gguf(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_serve(int argc, char **argv);
/* The benchmarks behind `moeq bench <name>` (bench_*.c, which may reach the library's
 * internals); each takes argv with argv[0] = its own name. */
int bench_eval(int argc, char **argv);
int bench_forward(int argc, char **argv);
int bench_gen_model(int argc, char **argv);
int bench_gptq(int argc, char **argv);
int bench_quantize(int argc, char **argv);
int bench_moe_ffn(int argc, char **argv);
int bench_tokenizer(int argc, char **argv);
/* inspect FILE.gguf (cmd_export_gguf.c) */
int cli_is_gguf(const char *path);
int cli_inspect_gguf(const char *path, int tensors);
#endif
