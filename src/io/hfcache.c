/*
 * Model names as users type them: a local directory, or a Hugging Face hub id ("org/name")
 * resolved to its snapshot in the local cache, laid out as huggingface_hub writes it:
 *   <hub>/models--<org>--<name>/refs/<revision>        the commit hash of a branch or tag
 *   <hub>/models--<org>--<name>/snapshots/<hash>/...   the files (links into blobs/)
 * <hub> is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub. moeq never
 * downloads; a missing model is an error that says where it looked.
 */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/core.h"

static bool is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* "org/name" with the characters the hub allows, neither part empty nor "." / "..". */
static bool is_hub_id(const char *s) {
    const char *slash = strchr(s, '/');
    if (strlen(s) > 200) return false;
    if (!slash || strchr(slash + 1, '/') || slash == s || !slash[1]) return false;
    if (!strncmp(s, "./", 2) || !strncmp(s, "../", 3) || !strcmp(slash, "/.") || !strcmp(slash, "/.."))
        return false;
    for (const char *c = s; *c; c++)
        if (c != slash && !isalnum((unsigned char)*c) && *c != '-' && *c != '_' && *c != '.') return false;
    return true;
}

static bool is_commit(const char *s) {
    if (strlen(s) != 40) return false;
    for (const char *c = s; *c; c++)
        if (!isxdigit((unsigned char)*c)) return false;
    return true;
}

moeq_status moeq_resolve_model(const char *name, const char *revision, char **out) {
    *out = NULL;
    if (!name || !*name) return mq_err(MOEQ_E_ARG, "no model given");
    if (is_dir(name)) {
        if (revision) return mq_err(MOEQ_E_ARG, "%s: --revision %s is for hub ids; this is a directory", name, revision);
        *out = mq_strndup(name, strlen(name));
        return *out ? MOEQ_OK : MOEQ_E_NOMEM;
    }
    if (!is_hub_id(name)) {   /* a path (or a file): the caller opens it and says what is wrong */
        if (revision) return mq_err(MOEQ_E_ARG, "%s: --revision %s is for hub ids (org/name)", name, revision);
        *out = mq_strndup(name, strlen(name));
        return *out ? MOEQ_OK : MOEQ_E_NOMEM;
    }
    const char *rev = revision ? revision : "main";
    if (!*rev || strstr(rev, "..") || rev[0] == '/')
        return mq_err(MOEQ_E_ARG, "--revision '%s': not a branch, tag or commit", rev);
    char hub[4096];
    const char *e = getenv("HF_HUB_CACHE"), *home = getenv("HF_HOME"), *user = getenv("HOME");
    const char *from;
    if (e && *e) {
        snprintf(hub, sizeof hub, "%s", e);
        from = "HF_HUB_CACHE";
    } else if (home && *home) {
        snprintf(hub, sizeof hub, "%s/hub", home);
        from = "HF_HOME/hub";
    } else {
        snprintf(hub, sizeof hub, "%s/.cache/huggingface/hub", user && *user ? user : "");
        from = "the default ~/.cache/huggingface/hub; HF_HUB_CACHE and HF_HOME are unset";
    }
    char repo[4600], org[256], nm[512];
    const char *slash = strchr(name, '/');
    snprintf(org, sizeof org, "%.*s", (int)(slash - name), name);
    snprintf(nm, sizeof nm, "%s", slash + 1);
    int r = snprintf(repo, sizeof repo, "%s/models--%s--%s", hub, org, nm);
    if (r < 0 || (size_t)r >= sizeof repo) return mq_err(MOEQ_E_ARG, "%s: the cache path is too long", name);
    char hash[128] = "", looked[4800];
    if (is_commit(rev)) {
        snprintf(hash, sizeof hash, "%s", rev);
        r = snprintf(looked, sizeof looked, "%s/snapshots/%s", repo, rev);
    } else {
        r = snprintf(looked, sizeof looked, "%s/refs/%s", repo, rev);
        if (r < 0 || (size_t)r >= sizeof looked) return mq_err(MOEQ_E_ARG, "--revision '%s': too long", rev);
        char *text = NULL;
        size_t len = 0;
        if (mq_read_file(looked, &text, &len) == MOEQ_OK) {
            size_t k = 0;
            while (k < len && k + 1 < sizeof hash && isxdigit((unsigned char)text[k])) {
                hash[k] = text[k];
                k++;
            }
            hash[k] = 0;
        }
        free(text);
    }
    char snap[4800];
    r = snprintf(snap, sizeof snap, "%s/snapshots/%s", repo, hash);
    if (r < 0 || (size_t)r >= sizeof snap) return mq_err(MOEQ_E_ARG, "%s: the cache path is too long", name);
    if (!*hash || !is_dir(snap)) {
        const char *why = !is_dir(repo) ? "the model is not in the cache"
                          : !*hash     ? "no such revision there"
                                       : "its snapshot folder is missing";
        return mq_err(MOEQ_E_NOTFOUND,
                      "%s: not a directory, and not in the Hugging Face cache: looked for %s (%s; the "
                      "cache from %s). moeq never downloads: fetch it first (huggingface-cli download %s%s%s)",
                      name, *hash ? snap : looked, why, from, name, revision ? " --revision " : "",
                      revision ? revision : "");
    }
    *out = mq_strndup(snap, strlen(snap));
    return *out ? MOEQ_OK : MOEQ_E_NOMEM;
}
