#!/usr/bin/env python3
"""Makes tiny random checkpoints of the families moeq has no fixture for (mixtral, qwen3_moe, and a
qwen2_moe with dense layers) and their transformers fp32 goldens, in the layout of
../shared/fixtures/models/*.golden.safetensors (input_ids, logits, hidden_states.0..L).

Run where PyTorch + transformers are installed (the GPU machine); CPU is used, fp32, deterministic:
    python3 scripts/gen_arch_goldens.py OUT_DIR [TOKENIZER_JSON]
Each model is saved in bf16 (as real checkpoints are), then reloaded in fp32 for the golden, as the
shared fixtures were made. Router weights are scaled up so top-k choices have clear margins and do not
flip on rounding differences between implementations.
"""
import json, os, shutil, sys
import torch
import transformers
from safetensors.torch import save_file

out_root = sys.argv[1]
tok_json = sys.argv[2] if len(sys.argv) > 2 else None
torch.manual_seed(1234)

def common(**kw):
    base = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)
    base.update(kw)
    return base

models = {
    "mixtral-tiny": transformers.MixtralConfig(**common(intermediate_size=96, num_local_experts=4,
                                                         num_experts_per_tok=2, rope_theta=1e6)),
    "qwen3moe-tiny": transformers.Qwen3MoeConfig(**common(head_dim=32, moe_intermediate_size=48,
        intermediate_size=128, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen2moe-dense-tiny": transformers.Qwen2MoeConfig(**common(moe_intermediate_size=48,
        intermediate_size=80, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
        tie_word_embeddings=True)),
}

for name, cfg in models.items():
    torch.manual_seed(abs(hash(name)) % 1000)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() >= 1 and "bias" not in pname:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.02)
            if pname.endswith("mlp.gate.weight") or pname.endswith("block_sparse_moe.gate.weight"):
                p.mul_(12.0)   # decisive routing
    d = os.path.join(out_root, name)
    os.makedirs(d, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(d)
    if tok_json:
        shutil.copy(tok_json, os.path.join(d, "tokenizer.json"))
    # reload exactly as a user would, fp32
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ref.eval()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 4096, (1, 64), generator=g)
    with torch.no_grad():
        o = ref(ids, output_hidden_states=True)
    tensors = {"input_ids": ids[0].to(torch.int32).contiguous(),
               "logits": o.logits[0].float().contiguous()}
    for i, h in enumerate(o.hidden_states):
        tensors[f"hidden_states.{i}"] = h[0].float().contiguous()
    save_file(tensors, os.path.join(out_root, name + ".golden.safetensors"))
    print(name, "saved", sorted(os.listdir(d)), "layers", len(o.hidden_states) - 1)
    # a fused-on-disk copy when this transformers version can write one
    try:
        fd = d + "-fused"
        model.to(torch.bfloat16).save_pretrained(fd, save_original_format=False)
        from safetensors import safe_open
        with safe_open(os.path.join(fd, "model.safetensors"), "pt") as f:
            keys = [k for k in f.keys() if "experts" in k][:4]
        print(name, "fused keys", keys)
    except Exception as e:
        print(name, "no fused save:", e)
print("transformers", transformers.__version__, "torch", torch.__version__)
