"""Kind ``lora``: low-rank factors on base ``nn.Linear`` layers, in peft's own file format.

Files: ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as peft's
``save_pretrained`` writes them (keys ``base_model.model.<module>.lora_A.weight`` (r, in) and
``...lora_B.weight`` (out, r)), so adapters trained with peft or sentence-transformers load
unchanged. peft itself is not used to serve them: its loader writes every key of the file into
the model it wraps, base tensors included. Here the config and the file's header are checked
first (fields, types, rank limit, declared shapes), then every key against the base's modules,
and only then are the factors read into fresh tensors.

Supported: ``r`` (1..:data:`MAX_RANK`), ``lora_alpha``, ``use_rslora``, ``target_modules`` (a
list of module names or name suffixes, ``"all-linear"``, or a simple regular expression).
Refused up front: everything that changes the forward in a way served here would ignore
(``modules_to_save``, ``use_dora``, ``bias`` other than ``"none"``, ``rank_pattern``, layer
selection, ...), initialisations that rewrite the base weights (PiSSA, OLoRA, CorDA, LoftQ),
other peft types, and unknown fields with a non-empty value.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qswap.atomic import atomic_copy
from qswap.encoders.kinds.base import (FOREIGN_HINT, AdapterKind, Attached, EncoderArtifact, LowRank,
                                       base_storage, check_header_dtypes, fresh_like, load_safetensors,
                                       read_safetensors_header, require_finite)
from qswap.errors import IntegrityError, InvalidInputError, NotFoundError

if TYPE_CHECKING:
    from qswap.encoders.base import BaseEncoder

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Ranks above this are not "low rank" for any base qswap serves (e5-small: hidden 384), and a
# declared rank is what a forward allocates for: refuse it before reading any tensor.
MAX_RANK = 256
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# Fields that describe how the adapter was made or trained, not what it computes.
_METADATA = {"peft_type", "auto_mapping", "base_model_name_or_path", "revision", "peft_version", "task_type",
             "inference_mode", "lora_dropout", "init_lora_weights", "megatron_core", "qalora_group_size",
             "ensure_weight_tying", "eva_config", "loftq_config", "corda_config", "lora_ga_config"}
_SUPPORTED = {"r", "lora_alpha", "use_rslora", "target_modules"}
# Required values of fields that change the forward; unknown fields must be empty too.
_NEUTRAL: dict[str, tuple[Any, ...]] = {"bias": ("none",), "fan_in_fan_out": (False,)}
# Initialisations that rewrite the base weights: the adapter alone is wrong on the original base.
_BASE_REWRITING_INIT = ("pissa", "olora", "corda", "loftq")
_INIT_OK = (True, False, "gaussian", "eva", "orthogonal")
_MAX_PATTERN = 256
_MAX_TARGETS = 4096


@dataclass(frozen=True)
class LoraSpec:
    """What a LoRA adapter computes, from its ``adapter_config.json``."""

    r: int
    alpha: float
    rslora: bool
    targets: tuple[str, ...] | str   # names / suffixes, "all-linear", or a regular expression

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def matches(self, module: str) -> bool:
        """peft's rule: a list entry equals the name or is a ``.``-suffix of it; a string is a full match."""
        if isinstance(self.targets, str):
            return self.targets == "all-linear" or re.fullmatch(self.targets, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.targets)


def _refuse(key: str, what: str, hint: str = "save the adapter with peft's LoraConfig defaults for that field"
            ) -> InvalidInputError:
    return InvalidInputError(f"encoder {key}: LoRA config {what}", hint)


def _short(v: Any, limit: int = 80) -> str:
    try:
        r = repr(v)
    except RecursionError:
        return "<deeply nested value>"
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _empty(v: Any) -> bool:
    return v is None or v is False or v == {} or v == [] or v == ""


def _check_regex(key: str, pattern: str) -> None:
    """A target regex is run against every module name: keep its matching time bounded.

    Catastrophic backtracking needs a quantified group or many unbounded quantifiers; both are
    refused (peft's own examples need at most two, e.g. ``.*\\.(query|value)``).
    """
    if len(pattern) > _MAX_PATTERN:
        raise _refuse(key, f"target_modules pattern is over {_MAX_PATTERN} characters", "list the module names")
    if re.search(r"\)\s*[*+{]", pattern) or len(re.findall(r"(?<!\\)[*+]|(?<!\\)\{\d*,\}", pattern)) > 3:
        raise _refuse(key, f"target_modules pattern {_short(pattern)} is too complex to match safely "
                           "(a repeated group, or more than 3 unbounded repeats)", "list the module names")
    try:
        re.compile(pattern)
    except re.error as e:
        raise _refuse(key, f"target_modules {_short(pattern)} is not a valid regular expression: {e}",
                      "list the module names") from None


def parse_config(key: str, cfg: Any) -> LoraSpec:
    """Validate an ``adapter_config.json`` and return what it computes; refuses what qswap cannot serve."""
    if not isinstance(cfg, dict):
        raise InvalidInputError(f"encoder {key}: {CONFIG_FILE} is a JSON {type(cfg).__name__}, not an object",
                                "save the adapter with peft's save_pretrained")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _refuse(key, f"peft_type {_short(peft_type)} is not LoRA", "only LoRA adapters are supported for kind 'lora'")
    for field_name, value in cfg.items():
        if not isinstance(field_name, str):
            raise _refuse(key, "has a non-string field name")
        if field_name in _METADATA or field_name in _SUPPORTED:
            continue
        if field_name in _NEUTRAL:
            # 0 == False in Python: a number is never a neutral value here.
            if value not in _NEUTRAL[field_name] or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                raise _refuse(key, f"{field_name}={_short(value)} is not supported (only {_NEUTRAL[field_name][0]!r})")
            continue
        if not _empty(value):
            if field_name == "modules_to_save":
                raise _refuse(key, f"modules_to_save={_short(value)} is not supported: it would replace whole base "
                                   "modules", "train without modules_to_save (only LoRA factors are served)")
            raise _refuse(key, f"field {field_name}={_short(value)} is not supported",
                          "train a plain LoRA (r, lora_alpha, target_modules, optionally use_rslora)")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INIT):
        raise _refuse(key, f"init_lora_weights={_short(init, 40)} rewrites the base weights, so the adapter alone does "
                           "not reproduce the tuned model", "convert it to a plain LoRA first "
                                                            "(peft's path_initial_model_for_weight_conversion)")
    if init not in _INIT_OK or (isinstance(init, (int, float)) and not isinstance(init, bool)):
        raise _refuse(key, f"init_lora_weights={_short(init, 40)} is unknown", "use peft's default initialisation")
    r = cfg.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool):
        raise _refuse(key, f"r={_short(r)} is not an integer", "r is the LoRA rank, e.g. 8, 32 or 128")
    if not 1 <= r <= MAX_RANK:
        raise _refuse(key, f"r={r} is outside 1..{MAX_RANK}", f"use a rank up to {MAX_RANK} (32 or 128 are good)")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _refuse(key, f"lora_alpha={_short(alpha)} is not a finite number", "lora_alpha is usually equal to r")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise _refuse(key, f"use_rslora={_short(rslora)} is not true/false")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        if targets != "all-linear":
            _check_regex(key, targets)
        spec_targets: tuple[str, ...] | str = targets
    elif isinstance(targets, list) and targets and len(targets) <= _MAX_TARGETS \
            and all(isinstance(t, str) and t and "\x00" not in t for t in targets):
        spec_targets = tuple(targets)
    else:
        raise _refuse(key, f"target_modules={_short(targets)} is not a non-empty list of module names",
                      "name the nn.Linear modules to adapt, e.g. [\"query\", \"value\"]")
    return LoraSpec(r=r, alpha=float(alpha), rslora=rslora, targets=spec_targets)


def _split_keys(key: str, names: list[str]) -> dict[str, set[str]]:
    """Module -> {"A", "B"} from the file's tensor names; any other name is refused."""
    out: dict[str, set[str]] = {}
    for n in names:
        m = _KEY.match(n)
        if m is None:
            raise InvalidInputError(
                f"encoder {key}: LoRA file holds tensor {_short(n, 160)}, which is not a LoRA factor "
                "(expected base_model.model.<module>.lora_A.weight / .lora_B.weight)",
                "a LoRA adapter may hold only its lora_A/lora_B factors; base weights are never replaced by one")
        out.setdefault(m["module"], set()).add(m["ab"])
    return out


class LoraKind(AdapterKind):
    """LoRA factors added to base ``nn.Linear`` outputs per row (rows of many encoders share a forward)."""

    name = "lora"
    files = (CONFIG_FILE, WEIGHTS_FILE)

    def save(self, staging: Path, *, tensors: dict[str, torch.Tensor] | None,
             lora_dir: Path | None) -> None:
        if lora_dir is None:
            raise InvalidInputError("a lora encoder needs lora_dir (peft save_pretrained output)",
                                    "pass the directory peft's save_pretrained wrote")
        for f in self.files:
            if not (Path(lora_dir) / f).exists():
                raise NotFoundError(f"{lora_dir} lacks {f}", "save the adapter with peft's save_pretrained")
            atomic_copy(Path(lora_dir) / f, staging / f)

    def load(self, art: EncoderArtifact) -> None:
        key = art.key
        try:
            cfg = json.loads((art.path / CONFIG_FILE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError, RecursionError) as e:
            raise IntegrityError(f"{art.path}: cannot read {CONFIG_FILE} of {key}: {_short(e, 200)}",
                                 "the adapter file is corrupt; re-export the encoder") from None
        spec = parse_config(key, cfg)
        header = read_safetensors_header(art.path / WEIGHTS_FILE, key)
        self._check_declared(key, spec, {n: shape for n, (_, shape) in header.items()})
        check_header_dtypes(key, header)
        state = load_safetensors(art.path / WEIGHTS_FILE, key)   # only now: every shape is within limits
        require_finite(key, state)
        art.lora_config, art.lora_state = cfg, state

    @staticmethod
    def _check_declared(key: str, spec: LoraSpec, shapes: dict[str, tuple[int, ...]]) -> None:
        """What needs no base: keys are LoRA factors, each module has both, shapes agree with ``r``."""
        if not shapes:
            raise InvalidInputError(f"encoder {key}: LoRA file holds no tensors", "re-export the adapter")
        modules = _split_keys(key, list(shapes))
        for module, ab in modules.items():
            if ab != {"A", "B"}:
                raise InvalidInputError(f"encoder {key}: LoRA module {_short(module, 160)} lacks lora_{({'A', 'B'} - ab).pop()}",
                                        "re-export the adapter: every target module needs both factors")
            a = shapes[f"base_model.model.{module}.lora_A.weight"]
            b = shapes[f"base_model.model.{module}.lora_B.weight"]
            if len(a) != 2 or len(b) != 2 or a[0] != spec.r or b[1] != spec.r:
                raise InvalidInputError(
                    f"encoder {key}: LoRA factors of {_short(module, 160)} have shapes {a} and {b}, "
                    f"config says rank {spec.r} (expected (r, in) and (out, r))",
                    "the weights and adapter_config.json do not belong together; re-export the adapter")

    def attach(self, art: EncoderArtifact, base: BaseEncoder) -> Attached:
        key = art.key
        spec = parse_config(key, art.lora_config)   # again: the artifact may have been changed in memory
        state = art.lora_state or {}
        self._check_declared(key, spec, {n: tuple(t.shape) for n, t in state.items()})
        linear = {n: m for n, m in base.model.named_modules() if isinstance(m, torch.nn.Linear)}
        every = dict(base.model.named_modules())
        targeted = set(linear) if spec.targets == "all-linear" else {n for n in every if n and spec.matches(n)}
        if not targeted:
            raise InvalidInputError(f"encoder {key}: LoRA adapter does not fit base {base.name}: "
                                    f"target_modules {_show(spec.targets)} match no layer",
                                    FOREIGN_HINT)
        # peft adapts only the layers it knows; the base encoders qswap serves adapt Linear layers.
        odd = sorted(n for n in targeted if n not in linear)
        if odd:
            raise InvalidInputError(f"encoder {key}: LoRA target {odd[0]!r} is a {type(every[odd[0]]).__name__}, "
                                    "not a Linear layer", "target only nn.Linear modules (e.g. query, value, dense)")
        modules = _split_keys(key, list(state))
        extra = sorted(set(modules) - targeted)
        if extra:
            raise InvalidInputError(f"encoder {key}: LoRA adapter does not fit base {base.name}: "
                                    f"it holds factors for {_short(extra[0], 160)}, which its target_modules do not name "
                                    "or the base does not have", FOREIGN_HINT)
        missing = sorted(targeted - set(modules))
        if missing:
            raise InvalidInputError(f"encoder {key}: LoRA adapter does not fit base {base.name}: "
                                    f"no factors for target {missing[0]!r} ({len(missing)} missing)",
                                    "re-export the adapter from the model it was trained on")
        storage = base_storage(base)
        out: dict[str, LowRank] = {}
        for module in sorted(targeted):
            lin = linear[module]
            a = state[f"base_model.model.{module}.lora_A.weight"]
            b = state[f"base_model.model.{module}.lora_B.weight"]
            if tuple(a.shape) != (spec.r, lin.in_features) or tuple(b.shape) != (lin.out_features, spec.r):
                raise InvalidInputError(
                    f"encoder {key}: LoRA factors of {module!r} have shapes {tuple(a.shape)} and {tuple(b.shape)}, "
                    f"the base layer needs ({spec.r}, {lin.in_features}) and ({lin.out_features}, {spec.r})",
                    FOREIGN_HINT)
            require_finite(key, {module: a, f"{module}.B": b})
            w = lin.weight
            b_scaled = b.detach().to(device=w.device, dtype=w.dtype)
            if spec.scaling != 1.0:
                # A new tensor (the loaded one stays as read). Not made when the scaling is 1
                # (alpha = r, the usual export): the copy's freed original stayed resident as heap
                # fragments, 5 MiB per LoRA r=32 encoder of e5-small.
                b_scaled = b_scaled * spec.scaling
            require_finite(key, {f"{module} lora_B x scaling {spec.scaling:g}": b_scaled})
            out[module] = LowRank(a=fresh_like(a, w, storage), b=fresh_like(b_scaled, w, storage))
        return Attached(kind=self.name, low_rank=out,
                        info={"r": spec.r, "scaling": spec.scaling, "modules": len(out)})

    def runtime_tensors(self, att: Attached) -> dict[str, torch.Tensor]:
        """``<module>.lora_A`` (r, in) and ``<module>.lora_B`` (out, r, scaling included) per target."""
        out: dict[str, torch.Tensor] = {}
        for module, f in att.low_rank.items():
            out[f"{module}.lora_A"] = f.a
            out[f"{module}.lora_B"] = f.b
        return out


def _show(targets: tuple[str, ...] | str) -> str:
    return repr(targets if isinstance(targets, str) else list(targets)[:4])
