#!/usr/bin/env python3
"""Golden outputs of the chat templates in tests/data/chat_templates/ (tests/test_chat_template.c
compares moeq's renderer with them byte for byte).

Default: renders with jinja2 configured exactly as transformers' apply_chat_template does
(transformers/utils/chat_template_utils.py: ImmutableSandboxedEnvironment with trim_blocks,
lstrip_blocks and the loopcontrols extension; globals raise_exception and strftime_now; its
tojson filter, json.dumps with ensure_ascii=False) and writes tests/data/chat_goldens.json.

--transformers: renders every case with transformers' own tokenizer.apply_chat_template instead
and compares with the committed goldens (exit 1 on any difference); it also compares each stored
template with the model's own chat_template where that model is in the local Hugging Face cache.
Run on a machine with transformers:  python3 scripts/gen_chat_goldens.py --transformers
"""
import argparse
import json
import os
import sys
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "data")
TDIR = os.path.join(DATA, "chat_templates")

# template file -> (hub id the text comes from, its special tokens as transformers passes them)
TEMPLATES = {
    "llama3.2.jinja": ("meta-llama/Llama-3.2-1B-Instruct",
                       {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen3.jinja": ("Qwen/Qwen3-30B-A3B", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen2moe.jinja": ("Qwen/Qwen1.5-MoE-A2.7B-Chat",
                       {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "mixtral.jinja": ("mistralai/Mixtral-8x7B-Instruct-v0.1",
                      {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "olmoe.jinja": ("allenai/OLMoE-1B-7B-0924-Instruct",
                    {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|padding|>"}),
    "deepseek-v3.jinja": ("deepseek-ai/DeepSeek-V3",
                          {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}),
    "kimi-k2.jinja": ("moonshotai/Kimi-K2-Instruct", {"bos_token": "[BOS]", "eos_token": "[EOS]"}),
    "constructs.jinja": (None, {"bos_token": "<s>", "eos_token": "</s>"}),
}

SYS = {"role": "system", "content": "You are a helpful assistant. "}
U1 = {"role": "user", "content": "Hi there! Can you add 2 and 3?\n"}
A1 = {"role": "assistant", "content": "Sure: 2 + 3 = 5."}
U2 = {"role": "user", "content": "Thanks; and \"quoted\" ünïcødé 中文 text?"}
A_THINK = {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n5, of course."}
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
A_CALL = {"role": "assistant", "content": "",
          "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
A_CALL_STR = {"role": "assistant", "content": None,
              "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]}
T1 = {"role": "tool", "tool_call_id": "functions.add:0", "content": "5"}

# name -> (messages, extra variables)
CASES = {
    "user": ([U1], {}),
    "system_user": ([SYS, U1], {}),
    "multi_turn": ([SYS, U1, A1, U2], {}),
    "ends_assistant": ([U1, A1], {}),
    "no_system_multi": ([U1, A1, U2], {}),
    "think": ([U1, A_THINK, U2], {}),
    "think_off": ([U1], {"enable_thinking": False}),
    "tools": ([SYS, U1, A_CALL, T1], {"tools": TOOLS}),
    "tool_call_str": ([U1, A_CALL_STR, T1], {}),
    "bad_order": ([U1, U2], {}),
}
# which cases each template is rendered for (every case is rendered with add_generation_prompt true and false)
PLAN = {
    "llama3.2.jinja": ["user", "system_user", "multi_turn", "ends_assistant", "tools"],
    "qwen3.jinja": ["user", "system_user", "multi_turn", "ends_assistant", "think", "think_off", "tools"],
    "qwen2moe.jinja": ["user", "system_user", "multi_turn", "ends_assistant"],
    "mixtral.jinja": ["user", "system_user", "multi_turn", "ends_assistant", "bad_order"],
    "olmoe.jinja": ["user", "system_user", "multi_turn", "ends_assistant"],
    "deepseek-v3.jinja": ["user", "system_user", "multi_turn", "ends_assistant", "tool_call_str"],
    "kimi-k2.jinja": ["user", "system_user", "multi_turn", "ends_assistant", "tools"],
    "constructs.jinja": ["multi_turn", "no_system_multi"],
}
DATE = {"llama3.2.jinja": {"date_string": "26 Jul 2024"}}


def jinja_env():
    """The environment transformers builds (chat_template_utils._compile_jinja_template)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def case_vars(tname, cname, agp):
    msgs, extra = CASES[cname]
    v = {"messages": msgs, "tools": None, "documents": None, "add_generation_prompt": agp}
    v.update(TEMPLATES[tname][1])
    v.update(DATE.get(tname, {}))
    v.update(extra)
    return v


def render_jinja(env, text, v):
    try:
        return env.from_string(text).render(**v), None
    except Exception as e:  # the goldens record that it fails, and the message
        return None, f"{type(e).__name__}: {e}"


def render_transformers(text, v):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    v = dict(v)
    msgs, tools, agp = v.pop("messages"), v.pop("tools"), v.pop("add_generation_prompt")
    v.pop("documents")
    try:
        return tok.apply_chat_template(msgs, tools=tools, chat_template=text, add_generation_prompt=agp,
                                       tokenize=False, **v), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transformers", action="store_true",
                    help="render with transformers' apply_chat_template and compare with the committed goldens")
    ap.add_argument("--out", default=os.path.join(DATA, "chat_goldens.json"))
    args = ap.parse_args()

    if args.transformers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            sys.exit("gen_chat_goldens.py: --transformers needs the transformers package")
    cases = []
    env = None if args.transformers else jinja_env()
    for tname in sorted(PLAN):
        with open(os.path.join(TDIR, tname), encoding="utf-8") as f:
            text = f.read()
        for cname in PLAN[tname]:
            for agp in (True, False):
                v = case_vars(tname, cname, agp)
                out, err = render_transformers(text, v) if args.transformers else render_jinja(env, text, v)
                cases.append({"template": tname, "case": cname, "add_generation_prompt": agp,
                              "vars_json": json.dumps(v, ensure_ascii=False), "output": out, "error": err})
    if not args.transformers:
        import jinja2
        doc = {"generator": "scripts/gen_chat_goldens.py (jinja2 as transformers configures it)",
               "jinja2": jinja2.__version__, "cases": cases}
        tmp = args.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")
        os.replace(tmp, args.out)
        print(f"{len(cases)} cases -> {args.out}")
        return 0

    import transformers
    with open(args.out, encoding="utf-8") as f:
        gold = {(c["template"], c["case"], c["add_generation_prompt"]): c for c in json.load(f)["cases"]}
    bad = 0
    for c in cases:
        g = gold.get((c["template"], c["case"], c["add_generation_prompt"]))
        if g is None:
            print(f"MISSING {c['template']} {c['case']}")
            bad += 1
        elif (g["output"] != c["output"]) or ((g["error"] is None) != (c["error"] is None)):
            print(f"DIFFERENT {c['template']} {c['case']} agp={c['add_generation_prompt']}:\n"
                  f"  golden: {g['output']!r} {g['error']}\n  transformers: {c['output']!r} {c['error']}")
            bad += 1
    print(f"transformers {transformers.__version__}: {len(cases) - bad}/{len(cases)} cases equal the goldens")
    # the stored texts against the models' own, where the local cache has them
    try:
        from transformers import AutoTokenizer
        for tname, (hub, _) in sorted(TEMPLATES.items()):
            if not hub:
                continue
            try:
                t = AutoTokenizer.from_pretrained(hub, local_files_only=True, trust_remote_code=True)
            except Exception as e:
                print(f"{hub}: not in the local cache ({type(e).__name__})")
                continue
            ref = t.chat_template if isinstance(t.chat_template, str) else None
            with open(os.path.join(TDIR, tname), encoding="utf-8") as f:
                mine = f.read()
            print(f"{hub}: stored {tname} {'EQUALS' if ref == mine else 'DIFFERS FROM'} its chat_template")
    except ImportError:
        pass
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
