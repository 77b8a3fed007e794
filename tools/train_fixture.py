"""Train `builtin:fixture`: a small GLM-5 (`glm_moe_dsa`) model of the Python standard library.

Why: random tiny models have near-tied logits, so a KV tier "agreeing" with f32 on them measures
perturbation, not quality. This script trains, from scratch and reproducibly, a model whose
predictions mean something, so `latentkv eval ppl` can measure what each tier costs.

    .venv/bin/python tools/train_fixture.py --out src/latentkv/builtin/fixture      # CPU, ~1 h on 2 cores
    .venv/bin/python tools/train_fixture.py --device cuda --steps 3000 --out /tmp/fx  # a GPU trains far more

Corpus: every `*.py` file of the running Python's standard library (`sysconfig.get_paths()["stdlib"]`),
skipping the test suites (any directory named `test`, `tests` or `idle_test`) and `site-packages`.
A file belongs to the held-out test split when the first byte of SHA-256(its relative path) is a
multiple of 20 (about 5% of the files, the same on every machine with the same Python); the rest is
the training split. The held-out files are written, in path order, to `heldout.txt` (joined by
`<|endoftext|>`), so evaluation never depends on the local Python.

Steps:
1. a byte-level BPE tokenizer (4096 entries) trained with `tokenizers` on the training split;
2. the model: transformers' GlmMoeDsaForCausalLM (MLA with kv_lora 128 / qk_rope 32, 4 layers: 1 dense
   then 3 MoE with 8 routed experts top-2 + 1 shared) plus one multi-token-prediction (MTP) layer that
   predicts the token after next, saved as layer `num_hidden_layers` in DeepSeek-V3's layout;
3. pretraining on 1024-token windows with AdamW, warmup + cosine; the routers balanced without an
   auxiliary loss (DeepSeek-V3's bias update on `e_score_correction_bias`); the DSA indexer is
   bypassed (every token selected, which is what it does whenever the context fits `index_topk`);
4. optionally (`--indexer-steps`), the DSA indexer distilled from the frozen model's attention, as
   DeepSeek-V3.2 warmed its indexer up: KL(head-summed attention || softmax(index scores));
5. saving: bf16 safetensors + config.json + tokenizer.json + tokenizer_config.json + heldout.txt +
   train_token_counts.json (a unigram baseline for `eval ppl`) + training_log.json.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

EOT = "<|endoftext|>"
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


# --- corpus ---------------------------------------------------------------------------------


def corpus_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(train, heldout) lists of stdlib source files, in sorted path order."""
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & SKIP_DIRS:
            continue
        (heldout if hashlib.sha256(rel.as_posix().encode()).digest()[0] % 20 == 0 else train).append(path)
    return train, heldout


def read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# --- model ----------------------------------------------------------------------------------


def model_config(vocab_size: int, context: int, index_topk: int) -> dict:
    n_layers = 4
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "qk_head_dim": 64,
        "head_dim": 32,
        "v_head_dim": 64,
        "intermediate_size": 768,
        "moe_intermediate_size": 192,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense"] + ["sparse"] * (n_layers - 1),
        "layer_types": ["deepseek_sparse_attention"] * n_layers,
        "indexer_types": ["full"] * n_layers,
        "index_n_heads": 4,
        "index_head_dim": 64,
        "index_topk": index_topk,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": context,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": None,
        "use_cache": True,
    }


class MTPLayer(nn.Module):
    """DeepSeek-V3's multi-token prediction module (depth 1): from the main model's hidden state at
    i and the embedding of token i+1, predict token i+2 through one more decoder block."""

    def __init__(self, config, layer_idx: int):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
            GlmMoeDsaDecoderLayer,
            GlmMoeDsaRMSNorm,
        )

        super().__init__()
        cfg = copy.deepcopy(config)  # the block's layer index is one past the main stack
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
        cfg.indexer_types = list(cfg.indexer_types) + ["full"]
        cfg.layer_types = list(cfg.layer_types) + [cfg.layer_types[-1]]
        D = config.hidden_size
        self.enorm = GlmMoeDsaRMSNorm(D, config.rms_norm_eps)
        self.hnorm = GlmMoeDsaRMSNorm(D, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = GlmMoeDsaDecoderLayer(cfg, layer_idx)
        self.head_norm = GlmMoeDsaRMSNorm(D, config.rms_norm_eps)

    def state_items(self, prefix: str):
        """(checkpoint name, tensor) in DeepSeek-V3's MTP layout (embedding and head are shared)."""
        for name, t in self.state_dict().items():
            name = name.removeprefix("block.")
            name = name.replace("head_norm.", "shared_head.norm.")
            yield prefix + name, t


def bypass_indexer() -> None:
    """Make every DSA indexer select all (causal) tokens: what it does when the context fits
    index_topk, without computing its scores during pretraining."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    def select_all(self, hidden_states, *args, **kwargs):
        B, S, _ = hidden_states.shape
        return torch.arange(S, device=hidden_states.device, dtype=torch.int32).expand(B, S, S)

    m.GlmMoeDsaIndexer.forward = select_all


def build(cfg_dict: dict, seed: int):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    config = GlmMoeDsaConfig(**cfg_dict)
    config._attn_implementation = "sdpa"
    model = GlmMoeDsaForCausalLM(config)
    mtp = MTPLayer(config, cfg_dict["num_hidden_layers"])
    mtp.apply(model._init_weights)
    return config, model, mtp


def losses(model, mtp, config, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, S] -> (next-token loss, MTP loss for the token after next)."""
    from transformers.masking_utils import create_causal_mask

    h = model.model(input_ids=x).last_hidden_state  # [B, S, D], after the final norm
    main = F.cross_entropy(model.lm_head(h[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    e = model.model.embed_tokens(x[:, 1:])  # [B, S-1, D]: token i+1 for position i
    m = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h[:, :-1])], dim=-1))
    pos = torch.arange(m.shape[1], device=x.device)[None]
    mask = create_causal_mask(
        config=config,
        inputs_embeds=m,
        attention_mask=None,
        past_key_values=None,
        position_ids=pos,
        allow_is_causal_skip=False,
    )
    m, _ = mtp.block(
        m, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(m, pos)
    )
    logits = model.lm_head(mtp.head_norm(m[:, :-1]))  # predicts x[i+2]
    return main, F.cross_entropy(logits.flatten(0, 1), x[:, 2:].flatten())


class Balancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3): after each step, nudge each expert's
    routing bias toward the mean load."""

    def __init__(self, modules: list[nn.Module], rate: float):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

        self.rate = rate
        self.gates = [g for mod in modules for g in mod.modules() if isinstance(g, GlmMoeDsaTopkRouter)]
        self.loads = [None] * len(self.gates)
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def record(module, inputs, output):
            counts = torch.bincount(output[2].flatten(), minlength=module.num_experts).float()
            self.loads[i] = counts if self.loads[i] is None else self.loads[i] + counts

        return record

    @torch.no_grad()
    def step(self) -> float:
        """Apply the update; returns the worst max/mean load ratio seen this step."""
        worst = 1.0
        for gate, load in zip(self.gates, self.loads, strict=True):
            if load is None:
                continue
            gate.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst = max(worst, float(load.max() / load.mean().clamp_min(1)))
        self.loads = [None] * len(self.gates)
        return worst


# --- indexer distillation --------------------------------------------------------------------


def distill_indexer(model, config, batches, steps: int, lr: float, log) -> list[dict]:
    """Train each layer's indexer (wq_b, wk, k_norm, weights_proj) to match its layer's attention,
    summed over heads, with everything else frozen (DeepSeek-V3.2's dense warm-up stage)."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    model.config._attn_implementation = "eager"  # attention probabilities are the teacher
    captured: dict[int, dict] = {}

    def keep_inputs(i):
        def hook(module, args, kwargs):
            captured.setdefault(i, {})["h"] = kwargs["hidden_states"]
            captured[i]["pe"] = kwargs["position_embeddings"]

        return hook

    def keep_resid(i):
        def hook(module, inputs, output):
            captured.setdefault(i, {})["q_resid"] = output

        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(keep_inputs(i), with_kwargs=True)
        layer.self_attn.q_a_layernorm.register_forward_hook(keep_resid(i))
    params = [p for layer in model.model.layers for p in layer.self_attn.indexer.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    history = []
    for step in range(steps):
        x = next(batches)
        with torch.no_grad():
            out = model.model(input_ids=x, output_attentions=True)
        loss = 0.0
        for i, layer in enumerate(model.model.layers):
            probs = out.attentions[i].sum(dim=1)  # [B, S, T] head-summed attention
            target = probs / probs.sum(-1, keepdim=True)
            scores = _index_scores(layer.self_attn.indexer, captured[i], m)
            causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
            logp = torch.log_softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            loss = (
                loss
                + (target * (target.clamp_min(1e-12).log() - logp.masked_fill(~causal, 0))).sum(-1).mean()
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append({"step": step, "indexer_kl": float(loss) / len(model.model.layers)})
        log(f"indexer step {step + 1}/{steps}: KL {history[-1]['indexer_kl']:.4f}")
    model.config._attn_implementation = "sdpa"
    return history


def _index_scores(idx, cap: dict, m) -> torch.Tensor:
    """The indexer's scores [B, S, T] with gradients (its forward runs under no_grad)."""
    h, q_resid = cap["h"], cap["q_resid"]
    B, S, _ = h.shape
    cos, sin = cap["pe"]
    q = idx.wq_b(q_resid).view(B, S, idx.n_heads, idx.head_dim)
    q_rot, q_pass = q.split([idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    k = idx.k_norm(idx.wk(h)).unsqueeze(2)
    k_rot, k_pass = k.split([idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = m.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)  # [B, S, Hi, Di]
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)  # [B, T, Di]
    scores = F.relu(torch.einsum("bshd,btd->bsht", q, k) * idx.softmax_scale)
    weights = idx.weights_proj(h) * idx.n_heads**-0.5  # [B, S, Hi]
    return torch.einsum("bsh,bsht->bst", weights, scores)


# --- training loop --------------------------------------------------------------------------


def batch_stream(ids: torch.Tensor, batch: int, context: int, seed: int, device: str):
    """Random 1024-token windows of the training stream, forever (seeded)."""
    g = torch.Generator().manual_seed(seed)
    n = ids.numel() - context - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=g)
        yield torch.stack([ids[s : s + context] for s in starts.tolist()]).to(device)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain(model, mtp, config, batches, args, log) -> list[dict]:
    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    balancer = Balancer([model, mtp], args.balance_rate)
    history, t0 = [], time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        main, extra = losses(model, mtp, config, next(batches))
        loss = main + args.mtp_weight * extra
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        imbalance = balancer.step()
        row = {"step": step + 1, "loss": main.item(), "mtp_loss": extra.item(), "max_load_ratio": imbalance}
        history.append(row)
        if (step + 1) % args.log_every == 0 or step == 0:
            rate = (step + 1) / (time.time() - t0)
            eta = (args.steps - step - 1) / rate
            log(
                f"step {step + 1}/{args.steps}  loss {row['loss']:.3f}  mtp {row['mtp_loss']:.3f}  "
                f"load max/mean {imbalance:.2f}  {rate * 60:.1f} steps/min  eta {eta / 60:.1f} min"
            )
    return history


# --- saving ---------------------------------------------------------------------------------


def save(
    out: Path, model, mtp, cfg_dict: dict, tok, heldout: list[str], counts: list[int], meta: dict
) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    tensors.update(
        {
            k: v.detach().to(torch.bfloat16).contiguous()
            for k, v in mtp.state_items(f"model.layers.{cfg_dict['num_hidden_layers']}.")
        }
    )
    # Routing biases steer expert choice by small margins: keep them (tiny) in float32.
    for k in tensors:
        if k.endswith("e_score_correction_bias"):
            src = dict(
                model.state_dict(), **dict(mtp.state_items(f"model.layers.{cfg_dict['num_hidden_layers']}."))
            )
            tensors[k] = src[k].detach().float().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(cfg_dict, dtype="bfloat16", transformers_version=_version("transformers"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOT,
                "bos_token": None,
                "unk_token": None,
                "pad_token": None,
                "add_bos_token": False,
                "model_max_length": cfg_dict["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "heldout.txt").write_text(f"\n{EOT}\n".join(heldout), encoding="utf-8")
    (out / "train_token_counts.json").write_text(json.dumps(counts) + "\n")
    (out / "training_log.json").write_text(json.dumps(meta, indent=1) + "\n")


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    p.add_argument("--steps", type=int, default=800, help="pretraining steps (default: 800)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default: 4)")
    p.add_argument("--context", type=int, default=1024, help="training window = max_position_embeddings")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP loss (DeepSeek-V3: 0.3)")
    p.add_argument("--balance-rate", type=float, default=1e-3, help="router bias update speed")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument(
        "--indexer-steps", type=int, default=0, help="DSA indexer distillation steps after pretraining"
    )
    p.add_argument(
        "--index-topk", type=int, default=None, help="index_topk in the saved config (default: > context)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    t_start = time.time()
    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, heldout_files = corpus_files(root)
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    log(
        f"corpus {root}: {len(train_texts)} training files ({sum(map(len, train_texts)) / 1e6:.1f} M chars), "
        f"{len(heldout_texts)} held out ({sum(map(len, heldout_texts)) / 1e6:.2f} M chars)"
    )
    tok = train_tokenizer(train_texts, args.vocab)
    eot = tok.token_to_id(EOT)
    order = list(range(len(train_texts)))
    random.Random(args.seed).shuffle(order)
    stream: list[int] = []
    for i in order:
        stream.extend(tok.encode(train_texts[i]).ids)
        stream.append(eot)
    ids = torch.tensor(stream, dtype=torch.long)
    counts = torch.bincount(ids, minlength=tok.get_vocab_size()).tolist()
    log(f"tokenizer: {tok.get_vocab_size()} entries; training stream {ids.numel() / 1e6:.2f} M tokens")

    index_topk = args.index_topk or 2 * args.context
    cfg_dict = model_config(tok.get_vocab_size(), args.context, index_topk)
    config, model, mtp = build(cfg_dict, args.seed)
    model.to(args.device)
    mtp.to(args.device)
    n_params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())
    log(f"model: {n_params / 1e6:.2f} M parameters (MTP layer included)")
    batches = batch_stream(ids, args.batch, args.context, args.seed, args.device)
    bypass_indexer_forward = None
    if args.indexer_steps:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

        bypass_indexer_forward = m.GlmMoeDsaIndexer.forward
    bypass_indexer()
    model.train()
    history = pretrain(model, mtp, config, batches, args, log)
    t_pretrain = time.time() - t_start
    indexer_history: list[dict] = []
    if args.indexer_steps:
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

        m.GlmMoeDsaIndexer.forward = bypass_indexer_forward
        indexer_history = distill_indexer(model, config, batches, args.indexer_steps, 1e-3, log)
    meta = {
        "command": "tools/train_fixture.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "corpus_root": str(root),
        "train_files": len(train_texts),
        "heldout_files": [str(p.relative_to(root)) for p in heldout_files],
        "train_tokens": int(ids.numel()),
        "tokens_seen": args.steps * args.batch * args.context,
        "parameters": n_params,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "pretrain_seconds": round(t_pretrain, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "final_loss": history[-1]["loss"] if history else None,
        "history": history,
        "indexer_history": indexer_history,
    }
    save(args.out, model, mtp, cfg_dict, tok, heldout_texts, counts, meta)
    log(f"saved to {args.out} after {meta['total_seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
