/*
 * A GGUF file read as a checkpoint and written out as the directory moeq's loader and quantizer
 * open (gguf_import.c): io's GGUF views and documents (io/gguf_hf.h) through io's safetensors
 * writer.
 */
#ifndef MOEQ_IO_GGUF_IMPORT_H
#define MOEQ_IO_GGUF_IMPORT_H

#include "core/core.h"

/* A GGUF file (llama, olmoe, qwen2moe, qwen3moe, deepseek2; gpt2 tokenizer) written out as a
 * checkpoint directory moeq opens (config.json, tokenizer.json, model.safetensors with every
 * tensor decoded to F32; the config routes as llama.cpp's graph does). out_dir is created. */
moeq_status mq_gguf_import(const char *gguf_path, const char *out_dir);

#endif
