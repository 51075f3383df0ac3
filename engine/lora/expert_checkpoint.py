"""LoRA on a mixture-of-experts model's routed experts: reading and validating the adapter's expert tensors.

Two layouts reach the experts (`engine/model/moe.py` holds them as 3-D `gate_up` [E, 2I, H] and `down`
[E, H, I]):

- PEFT's `target_parameters` on transformers 5's fused expert parameters (`mlp.experts.gate_up_proj`,
  `mlp.experts.down_proj`). PEFT wraps each targeted parameter of a module in a `ParamWrapper`, nesting
  them in the module's registration order (gate_up_proj first, so innermost), and saves each wrapper's
  factors under the module with one `.base_layer` per level of nesting below the outermost::

      ...mlp.experts.base_layer.lora_A.weight   [E*r, H]   (gate_up_proj, when down_proj is targeted too)
      ...mlp.experts.lora_A.weight              [E*r, I]   (the outermost: down_proj here)

  with num_experts folded into the rank: lora_A is [E*r, in] expert-major (`A.view(E, r, in)[e]` is
  expert e's), lora_B is [out, r*E] rank-major (`B.view(out, r, E)[:, :, e]`), and the delta of expert
  e is `scaling * B_e @ A_e`, scaling alpha/r (alpha/sqrt(r) with rsLoRA) for the parameter's key
  `model.layers.N.mlp.experts.gate_up_proj` in `rank_pattern` / `alpha_pattern`.
- `target_modules` on per-expert linears, as adapters of the older per-expert models are saved
  (`experts.N.gate_proj/up_proj/down_proj`, Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`): each a
  plain LoRA of its own rank and alpha. gate and up are stacked into one LoRA of the packed gate|up rows,
  as PEFT converts them for transformers 5: A = [A_gate; A_up] along the rank, B block-diagonal.

Both become one `ExpertLoRAWeights` per (layer, projection): A [E, r, in], B [E, out, r] and one scaling
(per-expert scalings that differ are folded into B's columns). Experts an adapter leaves out, and ranks
below the largest, are zero rows, which add nothing.

Refused, naming the parameter or tensor: `target_parameters` on a model without experts or on anything
but the experts' two parameters (the router `gate.weight`, an attention weight, ...), DoRA or lora_bias
on experts, and tensors of experts `target_modules` does not select.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.lora.adapter_error import AdapterError
from engine.lora.expert_targets import (
    PER_EXPERT_NAMES,
    expert_features,
    module_selected,
    parameter_targets,
    sparse_layers,
)
from engine.model.registry import model_family
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.lora.adapter_rules import AdapterRules

_FUSED = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)\.lora_([AB])(?:\.[^.]+)?\.weight$"
)
_PER = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
_ANY_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.")
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+?)\.lora_[AB]")


@dataclass(slots=True, frozen=True)
class ExpertLoRAWeights:
    """One adapted expert projection of one layer: `delta_e = scaling * (x @ lora_a[e].T) @ lora_b[e].T`."""

    layer: int
    proj: str  # "gate_up" (the packed gate|up rows, gate first) or "down"
    rank: int
    scaling: float
    lora_a: torch.Tensor | None  # [E, rank, in]; None when inspected without weights
    lora_b: torch.Tensor | None  # [E, out, rank]


@dataclass(slots=True)
class _Piece:
    """The tensors of one fused parameter or one per-expert linear found in the file."""

    names: dict[str, str] = field(default_factory=dict)  # "A" / "B" -> tensor name


class ExpertTensors:
    """Collects an adapter's expert tensors (`take`) and turns them into `ExpertLoRAWeights` (`weights`)."""

    def __init__(self, config: dict[str, Any], model: ModelConfig, rules: AdapterRules) -> None:
        self.config, self.model, self.rules = config, model, rules
        self.params = parameter_targets(config, model)
        self.fused: dict[tuple[int, str], _Piece] = {}  # (layer, parameter) -> its A/B
        self.per: dict[tuple[int, str, int], dict[str, _Piece]] = {}  # (layer, proj, expert) -> half
        self.keys: dict[str, str] = {}  # tensor name -> the PEFT module key its rank/alpha are read for
        self._checkpoint_key = model_family(model.architecture).checkpoint_key
        self._experts = int(model.extra["moe"]["num_experts"]) if model.extra.get("moe") else 0

    def __bool__(self) -> bool:
        return bool(self.fused or self.per)

    def take(self, name: str) -> bool:
        """Record `name` if it is a LoRA tensor of the routed experts (refusing what is not served)."""
        m = _PEFT_KEY.match(name)
        if m is None or not self._experts:
            return False
        engine = self._checkpoint_key(m[1] + ".weight")
        if engine is None:
            return False
        engine_name = str(engine).removesuffix(".weight") + name[m.end(1) :]
        fused, per = _FUSED.match(engine_name), _PER.match(engine_name)
        if fused is None and per is None:
            if _ANY_EXPERT.match(engine_name):
                raise AdapterError(
                    f"tensor {name!r}: not served on the experts (only plain LoRA A/B weights; DoRA and "
                    "lora_bias on experts are not supported)"
                )
            return False
        if fused is not None:
            layer, depth, ab = int(fused[1]), fused[2].count(".base_layer"), fused[3]
            targeted = self.params.get(layer, [])
            if depth >= len(targeted):
                raise AdapterError(
                    f"tensor {name!r}: layer {layer}'s experts have no such target_parameters entry "
                    f"(it targets {targeted or 'none'})"
                )
            param = targeted[len(targeted) - 1 - depth]  # the outermost wrapper is the last parameter
            piece = self.fused.setdefault((layer, param), _Piece())
            self.keys[name] = f"model.layers.{layer}.mlp.experts.{param}"
        else:
            assert per is not None
            layer, expert, proj_name, ab = int(per[1]), int(per[2]), per[3], per[4]
            if proj_name not in PER_EXPERT_NAMES:
                raise AdapterError(f"tensor {name!r}: unknown expert module {proj_name!r}")
            if expert >= self._experts:
                raise AdapterError(
                    f"tensor {name!r}: expert {expert} out of range (the model has {self._experts})"
                )
            if layer not in sparse_layers(self.model):
                raise AdapterError(f"tensor {name!r}: layer {layer} has no routed experts")
            if not module_selected(self.config, m[1], layer, self.model):
                raise AdapterError(
                    f"tensor {name!r}: module not selected by "
                    "target_modules/layers_to_transform/exclude_modules"
                )
            proj, half = PER_EXPERT_NAMES[proj_name]
            halves = self.per.setdefault((layer, proj, expert), {})
            piece = halves.setdefault(str(half), _Piece())
            self.keys[name] = m[1]
        if ab in piece.names:
            raise AdapterError(f"tensor {name!r}: duplicate lora_{ab}")
        piece.names[ab] = name
        return True

    def weights(
        self,
        header: dict[str, tuple[str, tuple[int, ...]]],
        tensors: dict[str, torch.Tensor],
        max_lora_rank: int,
        load_weights: bool,
    ) -> tuple[ExpertLoRAWeights, ...]:
        """The validated expert LoRAs, ordered by (layer, projection); shapes are checked against the base."""
        out = [
            self._fused_weights(k, p, header, tensors, max_lora_rank, load_weights)
            for k, p in self.fused.items()
        ]
        groups: dict[tuple[int, str], dict[int, dict[str, _Piece]]] = {}
        for (layer, proj, expert), halves in self.per.items():
            groups.setdefault((layer, proj), {})[expert] = halves
        if set(groups) & set(self.fused):
            clash = sorted(set(groups) & set(self.fused))[0]
            raise AdapterError(
                f"layer {clash[0]} experts: both target_parameters and per-expert LoRA tensors"
            )
        if (groups or self.fused) and (self.rules.use_dora or self.rules.lora_bias):
            flag = "use_dora" if self.rules.use_dora else "lora_bias"
            raise AdapterError(f"{flag}: not supported on the experts of a mixture-of-experts model")
        out += [
            self._per_expert_weights(layer, proj, experts, header, tensors, max_lora_rank, load_weights)
            for (layer, proj), experts in groups.items()
        ]
        return tuple(sorted(out, key=lambda w: (w.layer, w.proj != "gate_up")))

    def _rank_alpha(self, key: str, layer: int, what: str, max_lora_rank: int) -> tuple[int, float]:
        rank, r_field = self.rules.rank_for(key)
        if rank > max_lora_rank:
            raise AdapterError(
                f"{r_field}: rank {rank} of layer {layer} {what} exceeds max_lora_rank {max_lora_rank}"
            )
        return rank, self.rules.alpha_for(key)

    def _scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.rules.use_rslora else alpha / rank

    def _fused_weights(
        self,
        key: tuple[int, str],
        piece: _Piece,
        header: dict[str, tuple[str, tuple[int, ...]]],
        tensors: dict[str, torch.Tensor],
        max_lora_rank: int,
        load_weights: bool,
    ) -> ExpertLoRAWeights:
        layer, param = key
        names = _pair(piece)
        proj = param.removesuffix("_proj")
        rank, alpha = self._rank_alpha(self.keys[names["A"]], layer, f"experts.{param}", max_lora_rank)
        e = self._experts
        fin, fout = expert_features(self.model, proj)
        _check_shape(names["A"], header, (e * rank, fin), f"experts.{param}")
        _check_shape(names["B"], header, (fout, e * rank), f"experts.{param}")
        a = b = None
        if load_weights:
            a_flat, b_flat = _finite(names["A"], tensors), _finite(names["B"], tensors)
            a = a_flat.reshape(e, rank, fin).contiguous()
            b = b_flat.reshape(fout, rank, e).permute(2, 0, 1).contiguous()
        return ExpertLoRAWeights(layer, proj, rank, self._scaling(rank, alpha), a, b)

    def _per_expert_weights(
        self,
        layer: int,
        proj: str,
        experts: dict[int, dict[str, _Piece]],
        header: dict[str, tuple[str, tuple[int, ...]]],
        tensors: dict[str, torch.Tensor],
        max_lora_rank: int,
        load_weights: bool,
    ) -> ExpertLoRAWeights:
        """gate and up (halves "0", "1") stacked along the rank, block-diagonal in B; down as is."""
        hidden, inter = self.model.hidden_size, int(self.model.extra["moe"]["intermediate_size"])
        halves = ("0", "1") if proj == "gate_up" else ("None",)
        width = {"0": (hidden, inter), "1": (hidden, inter), "None": (inter, hidden)}
        found: dict[tuple[int, str], tuple[dict[str, str], int, float]] = {}
        for expert, pieces in experts.items():
            for half, piece in pieces.items():
                names = _pair(piece)
                rank, alpha = self._rank_alpha(
                    self.keys[names["A"]], layer, self.keys[names["A"]], max_lora_rank
                )
                fin, fout = width[half]
                _check_shape(names["A"], header, (rank, fin), self.keys[names["A"]])
                _check_shape(names["B"], header, (fout, rank), self.keys[names["A"]])
                found[(expert, half)] = names, rank, self._scaling(rank, alpha)
        ranks = {h: max((r for (_, hh), (_, r, _) in found.items() if hh == h), default=0) for h in halves}
        total = sum(ranks.values())
        scaling = next(iter(found.values()))[2]
        a = b = None
        if load_weights:
            fin_all, fout_all = expert_features(self.model, proj)
            a = torch.zeros(self._experts, total, fin_all)
            b = torch.zeros(self._experts, fout_all, total)
            for (expert, half), (names, rank, s) in found.items():
                col = 0 if half in ("0", "None") else ranks["0"]
                row = inter if half == "1" else 0
                fout = width[half][1]
                a[expert, col : col + rank] = _finite(names["A"], tensors)
                block = _finite(names["B"], tensors).float()
                b[expert, row : row + fout, col : col + rank] = (
                    block if s == scaling else block * (s / scaling)
                )
        return ExpertLoRAWeights(layer, proj, total, scaling, a, b)


def _pair(piece: _Piece) -> dict[str, str]:
    for ab in "AB":
        if ab not in piece.names:
            other = next(iter(piece.names.values()))
            raise AdapterError(f"tensor {other!r}: its lora_{ab} partner is missing")
    return piece.names


def _check_shape(
    name: str, header: dict[str, tuple[str, tuple[int, ...]]], want: tuple[int, ...], what: str
) -> None:
    shape = tuple(header[name][1])
    if shape != want:
        raise AdapterError(
            f"tensor {name!r}: shape {list(shape)} does not fit the base model's {what} "
            f"(expected {list(want)})"
        )


def _finite(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    t = tensors[name]
    if not torch.isfinite(t).all():
        raise AdapterError(f"tensor {name!r}: contains NaN or Inf values")
    return t
