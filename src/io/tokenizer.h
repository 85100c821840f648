/*
 * Internal helpers of the tokenizer.json / tiktoken.model reader (public API: moeq_tokenizer_* in
 * moeq.h).
 *
 * Supported (everything else fails at load with MOEQ_E_UNSUPPORTED naming the file and field):
 *  - model: BPE (vocab object; merges as ["a","b"] pairs or "a b" strings; ignore_merges;
 *    unk_token/fuse_unk/byte_fallback); no dropout, no continuing_subword_prefix/end_of_word_suffix.
 *  - normalizer: null, NFC, or a Sequence of NFC entries (Qwen2/Qwen3); NFC applies to the text
 *    between normalized=false added tokens, as in HF. normalized=true added tokens are matched
 *    by their content as written (HF matches their NFC form; the two differ only for content
 *    that is not NFC).
 *  - pre_tokenizer: ByteLevel (add_prefix_space, use_regex with the GPT-2 split regex), or a
 *    Sequence of Split pre-tokenizers (Regex or String pattern, behavior Isolated, not inverted)
 *    ending in ByteLevel (the Llama-3 / Qwen2 / DeepSeek layout).
 *  - decoder: ByteLevel.
 *  - added_tokens: matched in the raw text before pre-tokenization, leftmost-longest;
 *    normalized=false tokens first, then normalized=true ones in the remaining pieces (after NFC
 *    when the normalizer is NFC); lstrip/rstrip take Unicode White_Space;
 *    single_word rejects a match touching a word character (\w with PCRE2 Unicode properties,
 *    which may differ from Rust's \w on rare marks).
 * Regexes run on PCRE2 (UTF + UCP, JIT when available) where HF uses Oniguruma: \s, \p{L} and
 * \p{N} agree except that PCRE2's \s also takes U+180E.
 * Decoding follows HF's ByteLevel decoder: a token whose characters all belong to the byte
 * alphabet becomes those bytes, any other token (e.g. an added token with a space) its raw UTF-8.
 * A loaded tokenizer is immutable; encode/decode may run on several threads at once.
 * tiktoken.model (Kimi K2; tokenizer_config.json's auto_map must name tokenization_kimi):
 *  - lines "base64(token bytes) rank", ranks 0..N-1 each once, all 256 bytes present; a rank is
 *    the token's id; merging is tiktoken's (the adjacent pair whose joined bytes have the lowest
 *    rank first; a piece that is a token as it is);
 *  - the split pattern is tokenization_kimi.py's pat_str, rewritten for PCRE2
 *    (mq_tokenizer_kimi_split);
 *  - specials: ids N..N+255, named by tokenizer_config.json's added_tokens_decoder, the others
 *    "<|reserved_token_ID|>"; matched anywhere in the text (tiktoken's allowed_special="all");
 *  - not reproduced: tokenization_kimi.py's cutting of inputs over 400000 characters and of runs
 *    over 25000 spaces or non-spaces into separate encode calls.
 * Not supported: SentencePiece-style BPE (Metaspace pre-tokenizer, Replace/Prepend normalizers,
 * ByteFallback/Fuse/Strip decoders, e.g. Mixtral/Llama-2), WordPiece, Unigram, WordLevel.
 * Edge: after an rstrip token HF may still report a match that starts inside the stripped
 * spaces (overlapping pieces); here scanning resumes after the stripped spaces.
 */
#ifndef MOEQ_IO_TOKENIZER_H
#define MOEQ_IO_TOKENIZER_H

#include "core/core.h"

/* Kimi K2's split pattern (tokenization_kimi.py's pat_str) in PCRE2 syntax. */
extern const char mq_tokenizer_kimi_split[];

/* A tokenizer from a tokenizer.json document made in memory (a GGUF's, io/gguf_hf.h): as
 * moeq_tokenizer_load reads the file, with bos/eos from config (may be NULL) as from a
 * config.json beside it; label names it in messages. */
struct cJSON;
moeq_status mq_tokenizer_from_json(const char *label, const struct cJSON *root,
                                   const struct cJSON *config, moeq_tokenizer **out);

/* The tokenizer file of a model directory: tokenizer.json, else tiktoken.model (malloc'ed path);
 * NULL when it has neither. */
char *mq_tokenizer_find(const char *dir);

/* llama.cpp's name of the split pattern when the tokenizer's is a known one ("kimi-k2" for a
 * Kimi tiktoken.model), else NULL. */
const char *mq_tokenizer_pre_name(const moeq_tokenizer *tok);

/* True when the id is an added (special) token rather than one of the model's vocabulary. */
bool mq_tokenizer_is_added(const moeq_tokenizer *tok, int32_t id);

/* The merges as id pairs in rank order (*pairs: 2 * *n ids, malloc'ed): tokenizer.json's as read,
 * a tiktoken.model's recovered from its ranks. */
moeq_status mq_tokenizer_merges(const moeq_tokenizer *tok, int32_t **pairs, size_t *n);

/* Id of a token string (added tokens first, then the model vocabulary, as HF token_to_id);
 * -1 if unknown. */
int32_t mq_tokenizer_token_to_id(const moeq_tokenizer *tok, const char *s, size_t len);

/* The bytes one id decodes to (borrowed, not NUL-terminated; may be part of a UTF-8 character).
 * NULL for an id outside the vocabulary. Streaming output concatenates these. */
const char *mq_tokenizer_token_bytes(const moeq_tokenizer *tok, int32_t id, size_t *len);

/* Like moeq_tokenizer_decode but returns the raw bytes (no U+FFFD replacement of invalid UTF-8).
 * *out is malloc'ed and NUL-terminated. */
moeq_status mq_tokenizer_decode_bytes(const moeq_tokenizer *tok, const int32_t *ids, size_t n_ids,
                                      char **out, size_t *len);

/* Byte offset of the first invalid UTF-8 sequence in s[0..n), or n when s is valid (strict: no
 * overlong forms, surrogates or code points above U+10FFFF). */
size_t mq_utf8_check(const char *s, size_t n);

/* NFC (tokenizer_nfc.c). mq_nfc_quick_yes: true when s is NFC by the quick check (every code
 * point a starter with NFC_Quick_Check=Yes), so mq_nfc would return it unchanged. mq_nfc: the NFC
 * form of valid UTF-8 s[0..n) in a malloc'ed, NUL-terminated buffer. */
bool mq_nfc_quick_yes(const char *s, size_t n);
moeq_status mq_nfc(const char *s, size_t n, char **out, size_t *out_len);

#endif
