"""The MLA (DeepSeek-style) EAGLE-3 draft: which layer a run trains, the
draft decoder config it trains with, and the folder vLLM serves it from.

    [stages.train] draft_layer = "auto" | "llama" | "mla"

"auto" trains MLA layers where the target is MLA (`kv_lora_rank` in its text
config) and the vLLM in use needs it: vLLM's CPU build cannot pair an MLA
target with a Llama-layer draft ("No common block size for 16 (CPU_MLA:
[16]; CPU_ATTN: [MultipleOf(32)])"); everywhere else it keeps speculators'
Llama layer.

Training: speculators 0.9's own trainer with `--draft-config` naming a
DeepSeek-V3 decoder config derived from the target (`draft_layer_config`),
`--no-norm-before-fc` (vLLM's DeepSeek draft has no input norm) and the
layer classes of pipeline.train.mla_layer registered in the process.

Serving: vLLM 0.32 cannot read a speculators-format config whose layer is
not llama/qwen3, and rewrites a draft of model_type deepseek_v3 into MTP; it
loads the draft as `Eagle3DeepseekV2ForCausalLM` from a plain config of
model_type deepseek_v2. So beside each checkpoint the train stage writes

    train/out/vllm/<epoch>/config.json        the plain vLLM config
    train/out/vllm/<epoch>/model.safetensors  the checkpoint's tensors, t2d dropped
                                              (and embed_tokens while frozen:
                                              vLLM shares the target's)
    train/out/vllm/<epoch>/export.json        which checkpoint file it came from

written as a whole (a temporary folder renamed), its tensors checked against
what vLLM's loader fills — vLLM does not report a missing one. The
speculators checkpoint itself is left as it is (resume, from_pretrained).
Standard library only at import: the evaluate stage and doctor read it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.stage_error import StageError

LAYER_CHOICES = ("auto", "llama", "mla")
TRAIN_MODEL_TYPE = "deepseek_v3"          # speculators' transformer_layer_config
EXPORT_MODEL_TYPE = "deepseek_v2"         # vLLM: deepseek_v3 would become MTP
EXPORT_ARCH = "Eagle3DeepseekV2ForCausalLM"
EXPORT_DIR = "vllm"                       # train/out/vllm/<checkpoint name>/
MARKER = "export.json"
EXPORT_FORMAT = 1
CPU_CONFLICT = "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"
MLA_DIMS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
# the decoder fields the vLLM config copies from the trained layer config
COPIED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
          "qk_rope_head_dim", "v_head_dim", "hidden_act", "rms_norm_eps", "vocab_size",
          "max_position_embeddings", "rope_parameters", "attention_bias")


@dataclass
class DraftChoice:
    layer: str   # "llama" | "mla" | "own" (an algorithm's own layers)
    why: str


def text_config(raw: dict) -> dict:
    """The decoder's settings of a config.json (a multimodal wrapper keeps
    them under text_config)."""
    return raw.get("text_config") or raw


def choose_draft_layer(requested: str, mla_target: bool, probe_env) -> DraftChoice:
    """The draft layer `[stages.train] draft_layer` asks for, and why.
    `probe_env()` returns the VllmEnv of the vLLM in use (or None): called
    only when the answer depends on it."""
    if requested == "mla":
        if not mla_target:
            raise StageError('[stages.train] draft_layer = "mla" needs an MLA target (a '
                             "kv_lora_rank in its config); this target has none",
                             hint='set draft_layer = "auto" or "llama"')
        return DraftChoice("mla", 'draft_layer = "mla"')
    if requested == "llama":
        why = 'draft_layer = "llama"'
        if mla_target:
            env = probe_env()
            if env is not None and env.cpu_build:
                why += (f"; note: vLLM {env.version} (CPU build) cannot serve an MLA target "
                        f"with it ({CPU_CONFLICT}), so evaluate will fail there")
        return DraftChoice("llama", why)
    if not mla_target:
        return DraftChoice("llama", "auto: the target is not MLA")
    env = probe_env()
    if env is None or not env.dist:
        return DraftChoice("llama", "auto: the target is MLA, but no vLLM is installed to "
                           "serve it, and a Llama-layer draft needs no vLLM to train")
    if env.cpu_build:
        return DraftChoice("mla", f"auto: the target is MLA and vLLM {env.version} is the CPU "
                           f"build, which cannot pair it with a Llama-layer draft "
                           f"({CPU_CONFLICT})")
    return DraftChoice("llama", f"auto: the target is MLA; vLLM {env.version} (not the CPU "
                       "build) serves it with a Llama-layer draft")


def default_q_lora_rank(hidden_size: int) -> int:
    """A q_lora_rank for a target without one (vLLM 0.32's DeepSeek EAGLE-3
    loader needs one): DeepSeek-V3 / Kimi-K2 use 1536 at hidden 7168 (~0.21x);
    this takes hidden/4, a multiple of 16, between 32 and 1536."""
    return max(32, min(1536, (hidden_size // 4) // 16 * 16))


def rope_theta(text: dict) -> float:
    for where in (text.get("rope_parameters"), text.get("rope_scaling"), text):
        if isinstance(where, dict) and where.get("rope_theta"):
            return float(where["rope_theta"])
    return 10000.0


def draft_layer_config(target_raw: dict, num_layers: int) -> tuple[dict, list[str]]:
    """The DeepSeek-V3 decoder config (`--draft-config`) of an MLA draft for
    the target whose config.json is `target_raw`, and notes on what was not
    the target's own."""
    t = text_config(target_raw)
    missing = [k for k in ("hidden_size", "num_attention_heads", *MLA_DIMS) if not t.get(k)]
    if missing:
        raise StageError(f"the target's config has no {', '.join(missing)}: an MLA draft "
                         "copies its attention dimensions from the target",
                         hint='set [stages.train] draft_layer = "llama"')
    notes = []
    hidden = int(t["hidden_size"])
    q_lora = t.get("q_lora_rank")
    if not q_lora:
        q_lora = default_q_lora_rank(hidden)
        notes.append(f"q_lora_rank {q_lora} (the target has none; vLLM's DeepSeek EAGLE-3 "
                     "loader needs one)")
    inter = t.get("intermediate_size") or 4 * hidden
    if not t.get("intermediate_size"):
        notes.append(f"intermediate_size {inter} (4 x hidden: the target names none)")
    if t.get("hidden_act", "silu") != "silu":
        notes.append(f"hidden_act silu (the target's is {t['hidden_act']}; vLLM's draft "
                     "MLP takes silu only)")
    theta = rope_theta(t)
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        notes.append(f"rope default with the target's theta {theta:g} (the target's "
                     f"{rope.get('rope_type', rope.get('type'))} scaling is not carried over)")
    heads = int(t["num_attention_heads"])
    cfg = {
        "model_type": TRAIN_MODEL_TYPE,
        "hidden_size": hidden,
        "intermediate_size": int(inter),
        "num_hidden_layers": int(num_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": int(q_lora),
        "kv_lora_rank": int(t["kv_lora_rank"]),
        "qk_rope_head_dim": int(t["qk_rope_head_dim"]),
        "qk_nope_head_dim": int(t["qk_nope_head_dim"]),
        "v_head_dim": int(t["v_head_dim"]),
        "hidden_act": "silu",
        "rms_norm_eps": float(t.get("rms_norm_eps") or 1e-6),
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "rope_interleave": True,
        "first_k_dense_replace": int(num_layers),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": int(t.get("max_position_embeddings") or 4096),
        "vocab_size": int(t.get("vocab_size") or target_raw.get("vocab_size") or 0) or None,
        "initializer_range": float(t.get("initializer_range") or 0.02),
        "tie_word_embeddings": False,
    }
    if cfg["vocab_size"] is None:
        del cfg["vocab_size"]   # speculators sets the verifier's
    return cfg, notes


def mla_argv(argv: list[str], draft_config: Path) -> list[str]:
    """`speculators train` flags for the MLA draft: the decoder from
    `--draft-config` (which refuses `--num-layers`), no norm before fc."""
    out = list(argv)
    if "--num-layers" in out:
        i = out.index("--num-layers")
        del out[i:i + 2]
    return out + ["--draft-config", str(draft_config), "--no-norm-before-fc"]


def draft_config_path(argv: list[str]) -> Path | None:
    """The `--draft-config` of an MLA draft in `argv`, else None."""
    if "--draft-config" not in argv[:-1]:
        return None
    path = Path(argv[argv.index("--draft-config") + 1])
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return path if raw.get("model_type") == TRAIN_MODEL_TYPE else None


def argv_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


# -- checkpoints -> vLLM ---------------------------------------------------------


def is_mla_checkpoint(folder: Path) -> bool:
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (raw.get("transformer_layer_config") or {}).get("model_type") == TRAIN_MODEL_TYPE


def layer_defaults(tl: dict) -> dict:
    """The full DeepSeek-V3 layer config of a saved (diff) one, {} without
    transformers."""
    try:
        from transformers import DeepseekV3Config
    except ImportError:
        return {}
    return DeepseekV3Config(**tl).to_dict()


def vllm_config(spec: dict) -> dict:
    """The plain config.json vLLM 0.32 loads as `Eagle3DeepseekV2ForCausalLM`,
    from a speculators Eagle3 checkpoint's config.json."""
    tl = spec.get("transformer_layer_config") or {}
    if tl.get("model_type") != TRAIN_MODEL_TYPE:
        raise ValueError(f"not an MLA draft (its layer is {tl.get('model_type')!r})")
    tl = {**layer_defaults(tl), **tl}   # saved as a diff: a default value may be left out
    if spec.get("norm_before_fc"):
        raise ValueError("the draft was trained with norm_before_fc, which vLLM's DeepSeek "
                         "EAGLE-3 draft does not have (train with --no-norm-before-fc)")
    if not tl.get("q_lora_rank"):
        raise ValueError("the draft has no q_lora_rank: vLLM 0.32's DeepSeek EAGLE-3 loader "
                         "always fuses q_a_proj with kv_a_proj_with_mqa")
    if tl.get("hidden_act", "silu") != "silu":
        raise ValueError(f"vLLM's draft MLP takes silu, not {tl.get('hidden_act')}")
    missing = [k for k in COPIED if k not in tl and k not in ("attention_bias",)]
    if missing:
        raise ValueError(f"the checkpoint's layer config lacks {', '.join(missing)}")
    ids = spec.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError("the checkpoint names no eagle_aux_hidden_state_layer_ids")
    out = {"architectures": [EXPORT_ARCH], "model_type": EXPORT_MODEL_TYPE}
    out.update({k: tl[k] for k in COPIED if k in tl})
    out.update({
        "first_k_dense_replace": tl["num_hidden_layers"],
        "tie_word_embeddings": False,
        "draft_vocab_size": spec.get("draft_vocab_size") or tl["vocab_size"],
        "norm_before_residual": bool(spec.get("norm_before_residual", False)),
        "norm_output": bool(spec.get("norm_output", False)),
        "fc_norm": bool(spec.get("fc_norm", False)),
        "target_hidden_size": spec.get("target_hidden_size") or tl["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids),
                         "use_aux_hidden_state": True},
        "dtype": spec.get("dtype") or "bfloat16",
    })
    return out


def expected_tensors(cfg: dict, with_embed: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM's `Eagle3DeepseekV2ForCausalLM` fills from the export
    (checkpoint names), with its shape."""
    h, th = cfg["hidden_size"], cfg["target_hidden_size"]
    nh, qr, kvr = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    inter, vd, v = cfg["intermediate_size"], cfg["draft_vocab_size"], cfg["vocab_size"]
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    out: dict[str, tuple[int, ...]] = {"fc.weight": (h, n_aux * th), "norm.weight": (h,),
                                       "lm_head.weight": (vd, h)}
    if cfg.get("fc_norm"):
        out.update({f"fc_norm.{i}.weight": (th,) for i in range(n_aux)})
    if vd != v:
        out["d2t"] = (vd,)
    if with_embed:
        out["embed_tokens.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p, width = f"layers.{i}.", (2 * h if i == 0 else h)
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_a_proj.weight": (qr, width),
            p + "self_attn.q_a_layernorm.weight": (qr,),
            p + "self_attn.q_b_proj.weight": (nh * (dn + dr), qr),
            p + "self_attn.kv_a_proj_with_mqa.weight": (kvr + dr, width),
            p + "self_attn.kv_a_layernorm.weight": (kvr,),
            p + "self_attn.kv_b_proj.weight": (nh * (dn + dv), kvr),
            p + "self_attn.o_proj.weight": (h, nh * dv),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if i == 0:
            out[p + "hidden_norm.weight"] = (h,)
    return out


def safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape from a .safetensors file's header (no tensor read)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def tensor_problems(cfg: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What is missing, extra or misshapen in an export's tensors."""
    want = expected_tensors(cfg, with_embed="embed_tokens.weight" in shapes)
    problems = [f"missing {k} {list(s)}" for k, s in want.items() if k not in shapes]
    problems += [f"unexpected {k} (vLLM's loader would refuse it)" for k in shapes
                 if k not in want]
    problems += [f"{k} is {list(shapes[k])}, vLLM expects {list(s)}" for k, s in want.items()
                 if k in shapes and tuple(shapes[k]) != tuple(s)]
    return problems


def validate_export(folder: Path) -> list[str]:
    """Problems of an export folder (empty: vLLM loads all of it)."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
        shapes = safetensors_header(folder / "model.safetensors")
    except (OSError, ValueError, struct.error) as e:
        return [f"unreadable: {e}"]
    problems = []
    if cfg.get("architectures") != [EXPORT_ARCH] or cfg.get("model_type") != EXPORT_MODEL_TYPE:
        problems.append(f"config says {cfg.get('architectures')} / {cfg.get('model_type')}, "
                        f"not [{EXPORT_ARCH}] / {EXPORT_MODEL_TYPE}")
    for key in ("target_hidden_size", "q_lora_rank", "draft_vocab_size"):
        if not cfg.get(key):
            problems.append(f"config has no {key}")
    if not (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        problems.append("config has no eagle_config.eagle_aux_hidden_state_layer_ids")
    if problems:
        return problems
    return tensor_problems(cfg, shapes)


def source_id(checkpoint: Path) -> dict:
    """What identifies the checkpoint file an export was made from."""
    st = (Path(checkpoint) / "model.safetensors").stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def export_is_current(checkpoint: Path, export: Path) -> bool:
    """The export was made from this checkpoint's current file and is whole."""
    try:
        marker = json.loads((Path(export) / MARKER).read_text())
        return (marker.get("format") == EXPORT_FORMAT
                and marker.get("source") == source_id(checkpoint)
                and (Path(export) / "model.safetensors").is_file()
                and (Path(export) / "config.json").is_file())
    except (OSError, ValueError):
        return False


def export_tensors(checkpoint: Path, spec: dict, cfg: dict) -> tuple[dict, list[str]]:
    """The checkpoint's tensors as vLLM loads them (checked against `cfg`,
    its vLLM config), and what was dropped."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(checkpoint / "model.safetensors"))
    dropped = ["t2d"] if tensors.pop("t2d", None) is not None else []
    if not spec.get("embed_requires_grad") and tensors.pop("embed_tokens.weight", None) \
            is not None:
        dropped.append("embed_tokens.weight (frozen: vLLM shares the target's)")
    if cfg["draft_vocab_size"] == cfg["vocab_size"] and tensors.pop("d2t", None) is not None:
        dropped.append("d2t (the draft vocabulary is the target's)")
    problems = tensor_problems(cfg, {k: tuple(v.shape) for k, v in tensors.items()})
    if problems:
        raise StageError(f"the export of {checkpoint} for vLLM would not load whole: "
                         + "; ".join(problems[:8]),
                         hint="a bug in the MLA draft's layer or export; report it")
    if "d2t" in tensors:
        tensors["d2t"] = tensors["d2t"].to(torch.int64)
    return tensors, dropped


def export_for_vllm(checkpoint: Path, dest: Path) -> dict:
    """Write `dest` (a folder vLLM serves as the draft) from the speculators
    checkpoint `checkpoint`: written aside, validated, then renamed into
    place. Returns what export.json records."""
    from safetensors.torch import save_file

    from pipeline.run.diskspace import ensure_room

    checkpoint, dest = Path(checkpoint), Path(dest)
    spec = json.loads((checkpoint / "config.json").read_text())
    try:
        cfg = vllm_config(spec)
    except ValueError as e:
        raise StageError(f"cannot export {checkpoint} for vLLM: {e}",
                         hint='train the draft again with [stages.train] draft_layer = "mla"') \
            from None
    source = source_id(checkpoint)
    tensors, dropped = export_tensors(checkpoint, spec, cfg)
    dest.parent.mkdir(parents=True, exist_ok=True)
    ensure_room(dest.parent, sum(t.numel() * t.element_size() for t in tensors.values())
                + (1 << 20), f"the vLLM export of checkpoint {checkpoint.name}")
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        problems = validate_export(tmp)
        if problems:
            raise StageError(f"the vLLM export of {checkpoint} failed its check: "
                             + "; ".join(problems[:8]), hint="report it")
        marker = {"format": EXPORT_FORMAT, "checkpoint": str(checkpoint), "source": source,
                  "dropped": dropped, "tensors": len(tensors), "exported_at": time.time()}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = dest.parent / f".old-{dest.name}-{os.getpid()}"
        if dest.exists():
            dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return marker


def sync_exports(save_path: Path, export_root: Path, log=print) -> list[Path]:
    """Bring `export_root/<name>` up to date with every complete checkpoint
    `save_path/<name>`: export the new and re-saved ones, drop those whose
    checkpoint is gone and any leftover of a cut-short write. Returns the
    folders written."""
    from pipeline.train.checkpoints import complete_checkpoint

    save_path, export_root = Path(save_path), Path(export_root)
    written = []
    if export_root.is_dir():
        for d in export_root.iterdir():
            if d.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(d, ignore_errors=True)
    names = set()
    if save_path.is_dir():
        for ckpt in sorted((d for d in save_path.iterdir() if d.name.isdigit()
                            and not d.is_symlink() and complete_checkpoint(d)),
                           key=lambda d: int(d.name)):
            names.add(ckpt.name)
            dest = export_root / ckpt.name
            if export_is_current(ckpt, dest):
                continue
            t0 = time.perf_counter()
            export_for_vllm(ckpt, dest)
            log(f"train: vLLM export of checkpoint {ckpt.name} -> {dest} "
                f"({time.perf_counter() - t0:.1f} s)")
            written.append(dest)
    if export_root.is_dir():
        for d in export_root.iterdir():
            if d.is_dir() and d.name.isdigit() and d.name not in names:
                shutil.rmtree(d, ignore_errors=True)
    return written


def exporting_trainer(base, save_path: Path, export_root: Path):
    """speculators' Trainer class `base` that writes the vLLM export of each
    checkpoint as soon as it is complete (global rank 0 only; not for the
    save a stop request makes: the resumed stage exports it)."""

    class ExportingTrainer(base):
        def maybe_save_checkpoint(self, epoch, local_step=0):
            out = super().maybe_save_checkpoint(epoch, local_step)
            if epoch != "interrupted" and int(os.environ.get("RANK", "0")) == 0:
                sync_exports(save_path, export_root)
            return out

    return ExportingTrainer
