"""Train the built-in models: ``python -m tools.builtin_models.train``.

Stages (``--stage``, default ``all``; each can be rerun alone, later stages read the earlier
stages' outputs from ``--out``):

- ``data``: corpus split and byte-level BPE tokenizer (:mod:`tools.builtin_models.data`).
- ``target``: a Llama target trained with ``transformers`` on the training split.
- ``draft``: a 1-layer Llama draft model, initialised from the target's embedding, first layer
  and final norm, distilled from the target (KL to the target's next-token distribution).
- ``eagle``: an EAGLE-1 head (:class:`specdial.models.EagleHead`) trained on the target's
  final hidden states: feature regression (smooth L1) plus cross-entropy to the target's
  next-token distribution, unrolled over 3 draft steps ("training-time test": step ``j`` is fed
  the head's own step ``j - 1`` feature and attends to exactly the K/V the engine's chain
  drafting would hold).
- ``eval``: held-out perplexity per token of the target and the draft model.
- ``card``: ``MODEL_CARD.md`` from ``training_stats.json``.
- ``prompts``: ``python/specdial/bench/prompts/*.jsonl`` (:mod:`tools.builtin_models.prompts`).

Weights are saved in float16. The teachers of the draft and EAGLE stages are the *saved*
target weights (loaded as float32), i.e. the model that is served. Deterministic for a fixed
thread count (``--threads``, default 2): every random draw comes from fixed seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specdial.builtin import BUILTIN_DIR
from tools.builtin_models import data

PACKAGE_BUILTIN = BUILTIN_DIR  # the package's builtin/ folder, where the models ship
SAVE_DTYPE = torch.float16
SEED = 1234

# Deep and narrow: at batch size 1 on a CPU a forward's cost is mostly per-layer overhead, so
# the 8 layers (vs the drafters' 1) are what makes speculation pay, while hidden 256 lets the
# target see ~4M tokens in its ~30 min budget (a 25M-parameter target trained on the 1.4M
# tokens that budget allows for it only produced degenerate loops).
TARGET_ARCH = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)
SEQ_LEN = 384  # training window (tokens)
MAX_POSITIONS = 2048  # config max_position_embeddings

# stage defaults: (steps, sequences per step, peak learning rate)
DEFAULTS = {
    "target": dict(steps=1400, batch=8, lr=2.5e-3),
    "draft": dict(steps=600, batch=8, lr=1.5e-3),
    "eagle": dict(steps=600, batch=8, lr=1.5e-3),
}
EAGLE_UNROLL = 3  # draft steps simulated per EAGLE training sequence


def _log(msg: str) -> None:
    from tqdm import tqdm
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr)


def _progress(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, mininterval=5.0, dynamic_ncols=True, file=sys.stderr)


def lr_at(step: int, steps: int, peak: float, warmup_frac: float = 0.05,
          floor: float = 0.1) -> float:
    """Linear warmup, then cosine decay to ``floor * peak``."""
    warm = max(1, int(steps * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


# ----------------------------------------------------------------------------- stats file

def _stats_path(out: Path) -> Path:
    return out / "training_stats.json"


def load_stats(out: Path) -> dict[str, Any]:
    p = _stats_path(out)
    return json.loads(p.read_text()) if p.is_file() else {}


def update_stats(out: Path, key: str, value: Any) -> None:
    stats = load_stats(out)
    stats[key] = value
    out.mkdir(parents=True, exist_ok=True)
    _stats_path(out).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- data

class TokenData:
    """Tokenizer plus the token streams of the train and held-out splits."""

    def __init__(self, out: Path) -> None:
        from tokenizers import Tokenizer

        split = data.split_modules()
        self.summary = split.summary()
        self.tokenizer = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
        self.eot = self.tokenizer.token_to_id(data.EOT)
        self.train = np.asarray(data.encode_stream(self.tokenizer, split.train), dtype=np.int64)
        self.held_out = np.asarray(data.encode_stream(self.tokenizer, split.held_out),
                                   dtype=np.int64)
        # the held-out split without the codec tables of encodings/ (mostly hex literals)
        self.held_out_code = np.asarray(data.encode_stream(
            self.tokenizer, [m for m in split.held_out if not m.path.startswith("encodings/")]),
            dtype=np.int64)

    def batches(self, seed: int, steps: int, batch: int, seq_len: int = SEQ_LEN):
        """``steps`` batches ``[batch, seq_len + 1]`` of random training windows."""
        rng = np.random.default_rng(seed)
        hi = len(self.train) - seq_len - 1
        for _ in range(steps):
            starts = rng.integers(0, hi, size=batch)
            yield torch.from_numpy(np.stack([self.train[s:s + seq_len + 1] for s in starts]))

    def held_out_windows(self, n: int = 48, seq_len: int = SEQ_LEN,
                         code_only: bool = False) -> torch.Tensor:
        """``n`` evenly spaced held-out windows ``[n, seq_len]`` (deterministic);
        ``code_only``: from the held-out modules outside ``encodings/``."""
        stream = self.held_out_code if code_only else self.held_out
        starts = np.linspace(0, len(stream) - seq_len, n).astype(np.int64)
        return torch.from_numpy(np.stack([stream[s:s + seq_len] for s in starts]))


def stage_data(out: Path) -> None:
    split = data.split_modules()
    summary = split.summary()
    _log(f"corpus: {summary}")
    t0 = time.perf_counter()
    tok = data.train_tokenizer([m.text for m in split.train])
    for sub in ("target", "draft"):
        data.save_tokenizer(tok, out / sub, model_max_length=MAX_POSITIONS)
    ids = data.encode_stream(tok, split.train)
    held = data.encode_stream(tok, split.held_out)
    summary.update(vocab_size=tok.get_vocab_size(), train_tokens=len(ids),
                   held_out_tokens=len(held), tokenizer_seconds=round(time.perf_counter() - t0, 1),
                   held_out_paths=[m.path for m in split.held_out],
                   split_rule=f"int(sha1(relative module path).hexdigest(), 16) % "
                              f"{data.HELD_OUT_MODULUS} == 0")
    update_stats(out, "data", summary)


# ----------------------------------------------------------------------------- models

def _hf_config(num_layers: int, vocab_size: int, eot: int):
    import transformers

    arch = dict(TARGET_ARCH, num_hidden_layers=num_layers)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=True,
                                   max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, bos_token_id=None, eos_token_id=eot,
                                   pad_token_id=eot, **arch)
    cfg._attn_implementation = "sdpa"
    return cfg


def load_hf(path: Path):
    """A saved built-in model as a float32 ``transformers`` model in eval mode."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                          attn_implementation="sdpa")
    return model.eval()


def _save_hf(model, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.to(SAVE_DTYPE).save_pretrained(str(path), safe_serialization=True)
    model.to(torch.float32)


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _opt(params, lr: float):
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _train_loop(name: str, steps: int, lr: float, params, batches, loss_fn) -> dict[str, Any]:
    """Generic loop: AdamW, warmup + cosine, grad clip 1.0; returns timing and loss figures."""
    opt = _opt(params, lr)
    losses: list[float] = []
    extra_hist: dict[str, list[float]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    bar = _progress(steps, name)
    for step, batch in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        loss, extra = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        for k, v in extra.items():
            extra_hist.setdefault(k, []).append(v)
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
        if step % 20 == 0 or step == steps - 1:
            ex = " ".join(f"{k}={np.mean(v[-20:]):.3f}" for k, v in extra_hist.items())
            _log(f"{name} step {step}/{steps} loss={np.mean(losses[-20:]):.4f} {ex} "
                 f"lr={lr_at(step, steps, lr):.2e} {time.perf_counter() - t0:.0f}s "
                 f"(cpu {time.process_time() - c0:.0f}s)")
    bar.close()
    result = {"steps": steps, "peak_lr": lr, "seconds": round(time.perf_counter() - t0, 1),
              "cpu_seconds": round(time.process_time() - c0, 1),
              "final_loss": round(float(np.mean(losses[-20:])), 4),
              "first_loss": round(losses[0], 4)}
    for k, v in extra_hist.items():
        result[f"final_{k}"] = round(float(np.mean(v[-20:])), 4)
    return result


def stage_target(out: Path, td: TokenData, steps: int, batch: int, lr: float) -> None:
    import transformers

    torch.manual_seed(SEED)
    cfg = _hf_config(TARGET_ARCH["num_hidden_layers"], td.tokenizer.get_vocab_size(), td.eot)
    model = transformers.LlamaForCausalLM(cfg).train()
    params = [p for p in model.parameters() if p.requires_grad]
    _log(f"target: {_params(model) / 1e6:.2f}M parameters, {steps} steps x {batch} x {SEQ_LEN}")

    def loss_fn(b):
        logits = model(input_ids=b[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               b[:, 1:].reshape(-1)), {}

    result = _train_loop("target", steps, lr, params, td.batches(SEED + 1, steps, batch),
                         loss_fn)
    model.eval()
    _save_hf(model, out / "target")
    result.update(parameters=_params(model), tokens=steps * batch * SEQ_LEN, batch=batch,
                  seq_len=SEQ_LEN, arch=cfg.to_diff_dict() if hasattr(cfg, "to_diff_dict") else {})
    update_stats(out, "target", result)


def stage_draft(out: Path, td: TokenData, steps: int, batch: int, lr: float) -> None:
    import transformers

    torch.manual_seed(SEED + 10)
    target = load_hf(out / "target")
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = _hf_config(1, td.tokenizer.get_vocab_size(), td.eot)
    draft = transformers.LlamaForCausalLM(cfg)
    # start from the target's embedding (tied lm_head), first layer and final norm
    sd = target.state_dict()
    init = {k: v.clone() for k, v in sd.items()
            if k.startswith(("model.embed_tokens.", "model.norm.", "model.layers.0."))}
    missing, _ = draft.load_state_dict(init, strict=False)
    assert all(k == "lm_head.weight" for k in missing), missing
    draft.tie_weights()
    draft.train()
    params = [p for p in draft.parameters() if p.requires_grad]
    _log(f"draft: {_params(draft) / 1e6:.2f}M parameters, {steps} steps x {batch} x {SEQ_LEN}")

    def loss_fn(b):
        x = b[:, :-1]
        with torch.no_grad():
            t_logits = target(input_ids=x).logits.float()
        d_logits = draft(input_ids=x).logits.float()
        v = t_logits.shape[-1]
        t_logp = F.log_softmax(t_logits, -1).reshape(-1, v)
        d_logp = F.log_softmax(d_logits, -1).reshape(-1, v)
        kl = F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")
        with torch.no_grad():
            agree = (d_logp.argmax(-1) == t_logp.argmax(-1)).float().mean().item()
            ce = F.nll_loss(d_logp, b[:, 1:].reshape(-1)).item()
        return kl, {"data_ce": ce, "top1_agree": agree}

    result = _train_loop("draft", steps, lr, params, td.batches(SEED + 11, steps, batch), loss_fn)
    draft.eval()
    _save_hf(draft, out / "draft")
    result.update(parameters=_params(draft), tokens=steps * batch * SEQ_LEN, batch=batch,
                  seq_len=SEQ_LEN, loss="KL(target || draft)")
    update_stats(out, "draft", result)


# ----------------------------------------------------------------------------- EAGLE

def eagle_train_forward(head, input_ids: torch.Tensor, hidden_in: torch.Tensor,
                        prev_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    """Dense training forward of an :class:`EagleHead` over ``[B, T]`` sequences.

    Calls the head's own modules (``fc``, ``layers[0]``'s norms, projections and MLP, its
    rotary) exactly as ``EagleHead.forward`` does; only the attention is dense.

    ``hidden_in`` ``[B, T, H]``: the hidden state fed with each token (the target's
    ``h_{p-1}`` in pass 1, the head's own previous-pass output at ``p - 1`` later).
    ``prev_kv``: rotated K and V ``[B, kvh, T, D]`` of the earlier passes (empty/None for pass
    1). Pass ``j = len(prev_kv) + 1`` lets the query at ``p`` attend to pass-1 keys at
    positions ``<= p - j + 1`` and to pass ``i`` (``2 <= i <= j``) at position ``p - j + i``:
    what draft step ``j`` sees in chain drafting. Returns ``(out [B, T, H], (k, v))``.
    """
    from specdial.models.layers import apply_rotary

    prev_kv = prev_kv or []
    b, t = input_ids.shape
    layer = head.layers[0]
    attn = layer.self_attn
    hq, hk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    x = head.fc(torch.cat([head.embed_tokens(input_ids), hidden_in], -1))
    positions = torch.arange(t)
    cos, sin = head.rotary(positions, x.dtype)  # [T, 1, D] (cos, rot_sin)
    hn = layer.input_layernorm(x)

    def rot(z, heads):  # [B, T, heads*D] -> rotated [B, heads, T, D]
        z = z.view(b * t, heads, d)
        z = apply_rotary(z, cos.repeat(b, 1, 1), sin.repeat(b, 1, 1))
        return z.view(b, t, heads, d).transpose(1, 2)

    q = rot(attn.q_proj(hn), hq)
    k = rot(attn.k_proj(hn), hk)
    v = attn.v_proj(hn).view(b, t, hk, d).transpose(1, 2)
    rep = hq // hk
    j = len(prev_kv) + 1
    if j == 1:
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), is_causal=True,
                                           scale=attn.scale)
    else:
        k1, v1 = prev_kv[0]
        k1, v1 = k1.repeat_interleave(rep, 1), v1.repeat_interleave(rep, 1)
        scores = [(q @ k1.transpose(-1, -2)) * attn.scale]  # [B, H, T, T]
        pos = torch.arange(t)
        scores[0] = scores[0].masked_fill(~(pos[None, :] <= pos[:, None] - j + 1), float("-inf"))
        values = []
        extra = list(prev_kv[1:]) + [(k, v)]  # passes 2..j
        for i, (ki, vi) in enumerate(extra, start=2):
            shift = j - i  # key of pass i at position p - shift
            ki = ki.repeat_interleave(rep, 1)
            vi = vi.repeat_interleave(rep, 1)
            if shift:
                ki = F.pad(ki, (0, 0, shift, 0))[:, :, :t]
                vi = F.pad(vi, (0, 0, shift, 0))[:, :, :t]
            s = (q * ki).sum(-1, keepdim=True) * attn.scale  # [B, H, T, 1]
            s = s.masked_fill((pos < shift)[None, None, :, None], float("-inf"))
            scores.append(s)
            values.append(vi)
        probs = torch.softmax(torch.cat(scores, -1), -1)
        probs = torch.nan_to_num(probs)  # rows with no valid key (p < j - 1): zeros
        o = probs[..., :t] @ v1
        for i, vi in enumerate(values):
            o = o + probs[..., t + i:t + i + 1] * vi
    o = o.transpose(1, 2).reshape(b, t, hq * d)
    x = x + attn.o_proj(o)
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, (k, v)


def _shift_right(h: torch.Tensor) -> torch.Tensor:
    """``[B, T, H]`` -> row ``p`` holds ``h[p - 1]`` (zeros at ``p = 0``)."""
    return F.pad(h, (0, 0, 1, 0))[:, :-1]


def new_eagle_head(target_specdial, seed: int):
    from specdial.models import EagleHead, ModelConfig

    cfg = ModelConfig.from_dict(dict(target_specdial.config.to_dict(), num_hidden_layers=1))
    torch.manual_seed(seed)
    head = EagleHead(cfg, target_specdial.embed_tokens, target_specdial.lm_head)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return head


def stage_eagle(out: Path, td: TokenData, steps: int, batch: int, lr: float) -> None:
    from specdial.models import load_model, save_eagle_head

    target_hf = load_hf(out / "target")
    target_sd = load_model(out / "target", dtype=torch.float32)  # shares embed / lm_head
    for p in list(target_hf.parameters()) + list(target_sd.parameters()):
        p.requires_grad_(False)
    head = new_eagle_head(target_sd, SEED + 20)
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    _log(f"eagle: {_params(head) / 1e6:.2f}M parameters, {steps} steps x {batch} x {SEQ_LEN}, "
         f"{EAGLE_UNROLL} unrolled draft steps")
    weights = [1.0, 0.8, 0.6][:EAGLE_UNROLL]

    def loss_fn(b):
        x = b[:, :-1]
        with torch.no_grad():
            h = target_hf.model(input_ids=x).last_hidden_state.float()  # after final norm
            t_logp = F.log_softmax(target_hf.lm_head(h).float(), -1)
        kv: list = []
        hidden_in = _shift_right(h)
        total = torch.zeros(())
        extra: dict[str, float] = {}
        for j in range(EAGLE_UNROLL):
            f, kvj = eagle_train_forward(head, x, hidden_in, kv)
            kv.append(kvj)
            # pass j+1 feeds position p with this pass's output at p - 1; the first j
            # positions have no valid chain context and are not scored
            sl = slice(j, None)
            reg = F.smooth_l1_loss(f[:, sl], h[:, sl])
            logp = F.log_softmax(head.lm_head(f[:, sl]).float(), -1)
            ce = -(t_logp[:, sl].exp() * logp).sum(-1).mean()
            total = total + weights[j] * (reg + ce)
            with torch.no_grad():
                extra[f"agree{j + 1}"] = (logp.argmax(-1) == t_logp[:, sl].argmax(-1)).float().mean().item()
                if j == 0:
                    extra["reg1"] = reg.item()
            hidden_in = _shift_right(f.detach())
        return total, extra

    result = _train_loop("eagle", steps, lr, params, td.batches(SEED + 21, steps, batch), loss_fn)
    head.eval()
    half = new_eagle_head(target_sd, 0)
    half.load_state_dict({k: v.to(SAVE_DTYPE) for k, v in head.state_dict().items()})
    half.to(SAVE_DTYPE)
    save_eagle_head(half, out / "eagle")
    result.update(parameters=_params(head), tokens=steps * batch * SEQ_LEN, batch=batch,
                  seq_len=SEQ_LEN, unroll=EAGLE_UNROLL,
                  loss="sum over 3 unrolled draft steps (weights 1, .8, .6) of smooth-L1 "
                       "feature regression + CE to the target's next-token distribution")
    update_stats(out, "eagle", result)


# ----------------------------------------------------------------------------- eval

@torch.no_grad()
def held_out_ppl(model, windows: torch.Tensor, batch: int = 8) -> float:
    nll, n = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        logits = model(input_ids=w[:, :-1]).logits.float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                               reduction="sum").item()
        n += w[:, 1:].numel()
    return math.exp(nll / n)


def stage_eval(out: Path, td: TokenData) -> None:
    windows = td.held_out_windows()
    code = td.held_out_windows(code_only=True)
    res = {"windows": int(windows.shape[0]), "window_tokens": int(windows.shape[1]),
           "scored_tokens": int(windows[:, 1:].numel())}
    for name in ("target", "draft"):
        if (out / name / "model.safetensors").is_file():
            t0 = time.perf_counter()
            model = load_hf(out / name)
            res[f"{name}_ppl"] = round(held_out_ppl(model, windows), 3)
            res[f"{name}_ppl_code"] = round(held_out_ppl(model, code), 3)
            _log(f"held-out perplexity {name}: {res[f'{name}_ppl']} (without encodings/: "
                 f"{res[f'{name}_ppl_code']}) ({time.perf_counter() - t0:.0f}s)")
    update_stats(out, "eval", res)


# ----------------------------------------------------------------------------- card

def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6


def stage_card(out: Path) -> None:
    from tools.builtin_models.card import render_card

    stats = load_stats(out)
    sizes = {n: round(_dir_mb(out / n), 2) for n in ("target", "draft", "eagle")
             if (out / n).is_dir()}
    (out / "MODEL_CARD.md").write_text(render_card(stats, sizes))
    _log(f"wrote {out / 'MODEL_CARD.md'}")


# ----------------------------------------------------------------------------- main

STAGES = ("data", "target", "draft", "eagle", "eval", "card", "prompts")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.builtin_models.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", action="append", choices=STAGES + ("all",),
                    help="stage(s) to run (repeatable; default: all)")
    ap.add_argument("--out", type=Path, default=PACKAGE_BUILTIN,
                    help="output directory (default: the package's builtin/)")
    ap.add_argument("--prompts-out", type=Path, default=None,
                    help="prompt directory (default: the package prompt sets, python/specdial/bench/prompts)")
    ap.add_argument("--threads", type=int, default=2)
    for name, d in DEFAULTS.items():
        ap.add_argument(f"--{name}-steps", type=int, default=d["steps"])
        ap.add_argument(f"--{name}-batch", type=int, default=d["batch"])
        ap.add_argument(f"--{name}-lr", type=float, default=d["lr"])
    args = ap.parse_args(argv)
    stages = STAGES if not args.stage or "all" in args.stage else tuple(
        s for s in STAGES if s in args.stage)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    command = " ".join(["python -m tools.builtin_models.train"] + [
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])])
    update_stats(out, "runs", load_stats(out).get("runs", []) + [
        {"command": command, "stages": list(stages), "started": time.strftime("%Y-%m-%d %H:%M")}])
    update_stats(out, "threads", args.threads)
    update_stats(out, "versions", {"python": sys.version.split()[0], "torch": torch.__version__,
                                   "transformers": __import__("transformers").__version__,
                                   "tokenizers": __import__("tokenizers").__version__})
    if "data" in stages:
        stage_data(out)
    td = TokenData(out) if any(s in stages for s in ("target", "draft", "eagle", "eval")) else None
    for name, fn in (("target", stage_target), ("draft", stage_draft), ("eagle", stage_eagle)):
        if name in stages:
            fn(out, td, getattr(args, f"{name}_steps"), getattr(args, f"{name}_batch"),
               getattr(args, f"{name}_lr"))
    if "eval" in stages:
        stage_eval(out, td)
    if "prompts" in stages:
        from tools.builtin_models import prompts
        prompts.main(["--tokenizer", str(out / "target")]
                     + (["--out", str(args.prompts_out)] if args.prompts_out else []))
    if "card" in stages:
        stage_card(out)
    _log(f"done: {', '.join(stages)} in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
