"""Load drafters from local directories: EAGLE-1 and EAGLE-3 heads in the layouts SGLang and
vLLM load, specdial's own EAGLE layout, and draft models.

Architectures (``config.json`` ``architectures[0]``) and what they load as:

==========================  ========  ===============================================
architecture                algorithm layout (reference loader)
==========================  ========  ===============================================
``SpecdialEagleHead``       EAGLE     specdial (:mod:`specdial.models.eagle`)
``LlamaForCausalLMEagle``   EAGLE     SGLang ``llama_eagle.py``
``EagleLlamaForCausalLM``   EAGLE     vLLM ``llama_eagle.py``
``LlamaForCausalLMEagle3``  EAGLE3    SGLang / vLLM ``llama_eagle3.py``
``Eagle3LlamaForCausalLM``  EAGLE3    vLLM ``llama_eagle3.py``
``Eagle3Speculator``        EAGLE3    vLLM speculators format (``speculators_model_type``
                                      ``"eagle3"``, ``transformer_layer_config``)
``LlamaForCausalLM`` /      DRAFT     a draft model sharing the target's tokenizer; an
``Qwen2ForCausalLM``                  EAGLE head saved under this label (top-level
                                      ``fc.weight``, as many published heads are) loads
                                      as EAGLE or EAGLE3, as it does in SGLang and vLLM
                                      when the algorithm is named
==========================  ========  ===============================================

Published EAGLE-1 heads (SGLang, vLLM): tensors ``fc.weight`` ``[H, 2H]`` (``fc.bias`` if
present), ``layers.0.*`` without ``input_layernorm`` (the reference EAGLE code drops it); an
``embed_tokens.weight`` or ``lm_head.weight`` they carry is not used (both engines replace them
with the target's). EAGLE-3 heads: see :mod:`specdial.models.eagle3` for tensors; config fields
read: the Llama fields, ``draft_vocab_size`` (None: the full vocabulary), ``target_hidden_size``,
``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's reading, output of layer ``i``;
preferred when both are present) or top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM's,
input of layer ``i``), ``norm_before_residual`` (vLLM; default False, True in the speculators
format), ``bias`` (via ``fc.bias``). An EAGLE-3 head's own ``embed_tokens.weight`` is used only
when it differs from the target's (vLLM's rule; SGLang always uses the target's); without
``lm_head.weight`` the head shares the target's LM head (SGLang, ``draft_vocab_size`` None).
Names may carry a ``model.`` prefix (SGLang accepts it). Anything else is a ``ValueError``
naming the architecture or field and the supported ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from specdial.distributed.group import TensorParallel
from specdial.models.checkpoint import (assign_weights, build_on_meta, checkpoint_index,
                                        read_config, read_tensor, tensor_shapes)
from specdial.models.config import ModelConfig
from specdial.models.eagle import EAGLE_ARCHITECTURE, EagleHead
from specdial.models.eagle3 import TOP_LEVEL_IDS, Eagle3Head, Eagle3Spec, resolve_aux_layers
from specdial.models.llama import LlamaForCausalLM
from specdial.models.loader import SUPPORTED_ARCHITECTURES, load_model, load_tokenizer
from specdial.models.tensor_parallel import param_shard, shard_modules_, slice_shard

#: EAGLE-1 architectures: specdial's own, SGLang's, vLLM's.
EAGLE_ARCHITECTURES = (EAGLE_ARCHITECTURE, "LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
#: EAGLE-3 architectures (SGLang and vLLM, vLLM's alias, the speculators format).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
#: ``speculative_algorithm`` values that use a drafter.
DRAFT_ALGORITHMS = ("EAGLE", "EAGLE3", "DRAFT")

_SHARED = ("embed_tokens.weight", "lm_head.weight")


def _architecture(raw: dict[str, Any], path: Path) -> str:
    archs = raw.get("architectures") or []
    known = EAGLE_ARCHITECTURES + EAGLE3_ARCHITECTURES + SUPPORTED_ARCHITECTURES
    if len(archs) != 1 or archs[0] not in known:
        raise ValueError(f"unsupported drafter architecture {archs!r} in {path / 'config.json'};"
                         f" supported: EAGLE heads {', '.join(EAGLE_ARCHITECTURES)}; EAGLE-3 "
                         f"heads {', '.join(EAGLE3_ARCHITECTURES)}; draft models "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def infer_draft_algorithm(path: str | Path) -> str:
    """``"EAGLE"``, ``"EAGLE3"`` or ``"DRAFT"`` for the drafter directory ``path`` (table in
    the module docstring). Raises ``FileNotFoundError`` without config.json or weights and
    ``ValueError`` for an unsupported architecture or speculators type."""
    path = Path(path)
    raw = read_config(path)
    arch = _architecture(raw, path)
    spec_type = raw.get("speculators_model_type")
    if spec_type is not None and spec_type != "eagle3":
        raise ValueError(f"speculators_model_type {spec_type!r} in {path / 'config.json'} is "
                         "not supported; supported: 'eagle3'")
    if arch in EAGLE_ARCHITECTURES:
        return "EAGLE"
    if arch in EAGLE3_ARCHITECTURES:
        return "EAGLE3"
    files = checkpoint_index(path)
    fc = next((c for c in ("fc.weight", "model.fc.weight") if c in files), None)
    if fc is None:
        return "DRAFT"
    two_h = 2 * int(raw.get("hidden_size") or 0)
    eagle3 = any(c.removeprefix("model.").startswith("midlayer.") or c == "d2t" for c in files)
    width = tensor_shapes({fc: files[fc]})[fc][1]
    return "EAGLE3" if eagle3 or width != two_h else "EAGLE"


def resolve_draft_algorithm(path: str | Path, requested: str | None = None) -> str:
    """The algorithm to load ``path`` with: ``requested`` if given and compatible, else the
    inferred one. An EAGLE head labelled ``LlamaForCausalLM``/``Qwen2ForCausalLM`` (inferred
    from its tensors) loads as whichever of ``"EAGLE"``/``"EAGLE3"`` is requested (SGLang and
    vLLM rename the label after the algorithm named); other disagreements raise
    ``ValueError`` naming both."""
    inferred = infer_draft_algorithm(path)
    if requested is None or requested == inferred:
        return inferred
    if requested not in DRAFT_ALGORITHMS:
        raise ValueError(f"speculative_algorithm must be one of {DRAFT_ALGORITHMS}, got "
                         f"{requested!r}")
    arch = _architecture(read_config(Path(path)), Path(path))
    heads = ("EAGLE", "EAGLE3")
    if arch in SUPPORTED_ARCHITECTURES and inferred in heads and requested in heads:
        return requested
    raise ValueError(f"speculative_algorithm={requested!r} does not match the drafter in {path} "
                     f"(architecture {arch}, loads as {inferred!r})")


def load_drafter(path: str | Path, target: LlamaForCausalLM, algorithm: str | None = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp: TensorParallel | None = None) -> tuple[str, nn.Module]:
    """``(algorithm, module)`` for the drafter directory ``path``: an :class:`EagleHead`, an
    :class:`Eagle3Head` or a draft :class:`LlamaForCausalLM` (see
    :func:`resolve_draft_algorithm`). ``tp``: shard it over this tensor-parallel group, as
    the target is (see :func:`load_model`). Raises what the loaders raise."""
    algo = resolve_draft_algorithm(path, algorithm)
    if algo == "EAGLE":
        return algo, load_eagle_head(path, target, dtype, device, tp)
    if algo == "EAGLE3":
        return algo, load_eagle3_head(path, target, dtype, device, tp)
    return algo, load_model(path, dtype=dtype, device=device, tp=tp)


def load_engine_modules(model_dir: str | Path, draft_dir: str | Path | None,
                        algorithm: str | None, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu", tp: TensorParallel | None = None
                        ) -> tuple[LlamaForCausalLM, nn.Module | None, Any]:
    """``(target, drafter or None, tokenizer or None)``: what an engine runs. The drafter is
    loaded when both ``draft_dir`` and ``algorithm`` are given (:func:`load_drafter`); the
    tokenizer is the target directory's, None when it has none. ``tp``: shard both over this
    tensor-parallel group. Raises what the loaders raise."""
    target = load_model(model_dir, dtype=dtype, device=device, tp=tp)
    drafter = None
    if draft_dir is not None and algorithm is not None:
        _, drafter = load_drafter(draft_dir, target, algorithm, dtype=dtype, device=device, tp=tp)
    try:
        tokenizer = load_tokenizer(model_dir)
    except FileNotFoundError:
        tokenizer = None
    return target, drafter, tokenizer


def _head_config(path: Path, kind: str, archs: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    """The config dict and architecture of a head directory; ``ValueError`` unless the
    architecture is one of ``archs`` or a plain Llama/Qwen2 label."""
    raw = read_config(path)
    arch = _architecture(raw, path)
    if arch not in archs + SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch} is not an {kind} head; supported: "
                         f"{', '.join(archs)} (or a head labelled "
                         f"{' / '.join(SUPPORTED_ARCHITECTURES)})")
    return raw, arch


def _strip_model(name: str) -> str:
    return name if name.startswith("lm_head.") else name.removeprefix("model.")


def load_eagle_head(path: str | Path, target: LlamaForCausalLM,
                    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    tp: TensorParallel | None = None) -> EagleHead:
    """Load an EAGLE-1 head: specdial's layout (:mod:`specdial.models.eagle`) or SGLang's /
    vLLM's (module docstring). The head shares ``target.embed_tokens`` and ``target.lm_head``
    (sharded when the target is); ``tp`` shards its decoder layer (``fc`` is replicated).
    Raises ``FileNotFoundError`` without config.json or weights, ``ValueError`` for another
    architecture, a config that does not match the target, or missing, unexpected or
    mis-shaped tensors, naming them."""
    path = Path(path)
    raw, arch = _head_config(path, "EAGLE-1", EAGLE_ARCHITECTURES)
    own = arch == EAGLE_ARCHITECTURE
    config = ModelConfig.from_dict(raw)
    files = checkpoint_index(path)
    names: dict[str, str | None] = {}
    for c in files:
        n = c if own else _strip_model(c)
        if c.endswith("rotary_emb.inv_freq") or (not own and n in _SHARED):
            continue  # the target's embedding and LM head are used, as in SGLang and vLLM
        names[c] = n
    head = build_on_meta(EagleHead, config, target.embed_tokens, target.lm_head, input_norm=own,
                  fc_bias=own or "fc.bias" in names.values())
    if tp is not None:
        shard_modules_(head, tp)
    assign_weights(head, files, names, dtype, device)
    head.rotary.to(device)
    return head.eval()


def save_eagle_head(head: EagleHead, path: str | Path) -> None:
    """Write ``head`` as ``path/config.json`` + ``path/model.safetensors`` (creates ``path``):
    specdial's layout, or SGLang's (``LlamaForCausalLMEagle``) for a head without input norm."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_dict()
    cfg["architectures"] = [EAGLE_ARCHITECTURE if head.input_norm else "LlamaForCausalLMEagle"]
    cfg["num_hidden_layers"] = 1
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in head.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _eagle3_config(raw: dict[str, Any], arch: str,
                   target: ModelConfig) -> tuple[ModelConfig, dict[str, Any]]:
    """The head's Llama config and its EAGLE-3 fields (module docstring), validated."""
    spec_type = raw.get("speculators_model_type")
    if spec_type is not None:
        layer = raw.get("transformer_layer_config")
        if spec_type != "eagle3" or not isinstance(layer, dict):
            raise ValueError("a speculators config needs speculators_model_type 'eagle3' and a "
                             f"transformer_layer_config dict; got {spec_type!r}")
        if raw.get("norm_before_fc"):
            raise ValueError("norm_before_fc=true (an RMSNorm before fc) is not supported")
        llama = {**layer, "architectures": [arch]}
    else:
        llama = raw

    def get(key: str, default: Any = None) -> Any:
        return raw.get(key, llama.get(key, default))

    eagle_config = get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise ValueError(f"eagle_config must be an object, got {eagle_config!r}")
    if eagle_config.get("use_aux_hidden_state", True) is not True:
        raise ValueError("eagle_config.use_aux_hidden_state=false (an EAGLE-3 head over the "
                         "target's last hidden state only) is not supported")
    config = ModelConfig.from_dict(llama)
    if config.tie_word_embeddings:
        raise ValueError("tie_word_embeddings=true is not supported for an EAGLE-3 head")
    return config, {
        "aux_layers": resolve_aux_layers(eagle_config.get("eagle_aux_hidden_state_layer_ids"),
                                         get(TOP_LEVEL_IDS), target.num_hidden_layers),
        "target_hidden_size": int(get("target_hidden_size") or target.hidden_size),
        "draft_vocab_size": int(get("draft_vocab_size") or config.vocab_size),
        "norm_before_residual": bool(get("norm_before_residual", spec_type is not None)),
    }


def _eagle3_name(ckpt: str) -> str:
    name = _strip_model(ckpt)
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def load_eagle3_head(path: str | Path, target: LlamaForCausalLM,
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     tp: TensorParallel | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head (layouts and fields in the module docstring) for ``target``.
    ``tp``: shard its midlayer and its own vocabulary tensors over this group, as the target's.

    Raises ``FileNotFoundError`` / ``ValueError`` like :func:`load_eagle_head`, and
    ``ValueError`` when ``fc`` does not take the aux states the config selects (naming the
    field), for a reduced vocabulary without ``lm_head.weight``, or a bad ``d2t``/``t2d``.
    """
    path = Path(path)
    raw, arch = _head_config(path, "EAGLE-3", EAGLE3_ARCHITECTURES)
    config, fields = _eagle3_config(raw, arch, target.config)
    files = checkpoint_index(path)
    names: dict[str, str | None] = {}
    special: dict[str, str] = {}
    for c in files:
        n = _eagle3_name(c)
        if c.endswith("rotary_emb.inv_freq"):
            continue
        if n in ("d2t", "t2d") + _SHARED:
            special[n] = c
        else:
            names[c] = n
    spec = Eagle3Spec(fc_bias="fc.bias" in names.values(), **fields)
    fc = next((c for c, n in names.items() if n == "fc.weight"), None)
    width = len(spec.aux_layers) * spec.target_hidden_size
    if fc is not None and tensor_shapes({fc: files[fc]})[fc][1] != width:
        source = ("eagle_config.eagle_aux_hidden_state_layer_ids"
                  if "eagle_aux_hidden_state_layer_ids" in (raw.get("eagle_config") or {})
                  else TOP_LEVEL_IDS if TOP_LEVEL_IDS in raw else "the default aux layers")
        raise ValueError(f"{fc} takes {tensor_shapes({fc: files[fc]})[fc][1]} inputs but "
                         f"{source} selects {len(spec.aux_layers)} residual-stream states "
                         f"{list(spec.aux_layers)} of width {spec.target_hidden_size} "
                         f"({width}); set {TOP_LEVEL_IDS} or eagle_config.{TOP_LEVEL_IDS}")
    own_lm_head = "lm_head.weight" in special
    if own_lm_head:
        names[special["lm_head.weight"]] = "lm_head.weight"
    elif spec.draft_vocab_size != config.vocab_size:
        raise ValueError(f"lm_head.weight is missing and draft_vocab_size "
                         f"{spec.draft_vocab_size} differs from vocab_size {config.vocab_size}")
    own_embedding = False
    if "embed_tokens.weight" in special:
        c = special["embed_tokens.weight"]
        emb, ref = read_tensor(files, c).to(device=device, dtype=dtype), target.embed_tokens.weight
        shard = param_shard(target, "embed_tokens.weight")
        if shard is not None and tuple(emb.shape) == shard.full:
            emb = slice_shard(emb, shard)  # compare with this rank's rows of the target's
        own_embedding = emb.shape != ref.shape or not torch.equal(emb, ref)
        if own_embedding:
            names[c] = "embed_tokens.weight"
    head = build_on_meta(Eagle3Head, config, spec, target.embed_tokens,
                  None if own_lm_head else target.lm_head, own_embedding=own_embedding)
    if tp is not None:
        shard_modules_(head, tp)
    assign_weights(head, files, names, dtype, device)
    d2t, t2d = (read_tensor(files, special[k]) if k in special else None
                for k in ("d2t", "t2d"))
    head.set_vocab_map(d2t, t2d, device=device)
    head.rotary.to(device)
    return head.eval()
