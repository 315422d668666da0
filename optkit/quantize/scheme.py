"""A scheme says *what* a quantized weight is: bits, grouping, symmetry.

How the bits sit in memory (packing) lives in :mod:`optkit.export`; how scales and rounding
are chosen lives in the algorithms (:mod:`optkit.quantize.rtn`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Group sizes accepted by recipes. Each divides common hidden sizes and matches what
#: vLLM's Marlin / Machete kernels and torch's int4 CPU kernels accept.
SUPPORTED_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantScheme:
    """Integer weight quantization.

    Attributes:
        bits: 4 or 8.
        group_size: weights sharing one scale along the input dimension; ``None`` means one
            scale per output channel (the whole row).
        symmetric: if False, each group also has an integer zero point.
        act_bits: ``None`` for weight-only; ``8`` quantizes the layer's input activations
            to int8 dynamically, one symmetric scale per token (W8A8).
    """

    bits: int
    group_size: int | None = None
    symmetric: bool = True
    act_bits: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"group_size must be positive or None, got {self.group_size}")
        if self.act_bits not in (None, 8):
            raise ValueError(f"act_bits must be None or 8, got {self.act_bits}")

    # Signed storage range, as compressed-tensors defines it: int4 -> [-8, 7], int8 -> [-128, 127].
    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def strategy(self) -> str:
        return "channel" if self.group_size is None else "group"

    def fits(self, in_features: int) -> bool:
        return self.group_size is None or in_features % self.group_size == 0

    def label(self) -> str:
        g = "channel" if self.group_size is None else f"g{self.group_size}"
        a = "" if self.act_bits is None else f"-a{self.act_bits}"
        return f"int{self.bits}-{g}-{'sym' if self.symmetric else 'asym'}{a}"

    def bits_per_weight(self, in_features: int, scale_bits: int = 16) -> float:
        """Storage bits per weight of a layer ``in_features`` wide: codes, plus one scale (and
        zero point when asymmetric) per group; per channel, the group is the whole row."""
        overhead = scale_bits + (0 if self.symmetric else self.bits)
        return self.bits + overhead / (self.group_size or in_features)

    def to_compressed_tensors(self, actorder: bool = False) -> dict:
        """The ``weights`` QuantizationArgs of the compressed-tensors format.

        ``actorder``: GPTQ ran in activation order with static groups ("weight" in
        compressed-tensors): the stored layout is unchanged, runtimes need no ``g_idx``.
        """
        return {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": self.strategy,
            "group_size": self.group_size,
            "dynamic": False,
            "actorder": "weight" if actorder else None,
            "observer": "minmax",
        }

    def input_activations_compressed_tensors(self) -> dict | None:
        """The ``input_activations`` QuantizationArgs (dynamic per-token int8), or None."""
        if self.act_bits is None:
            return None
        return {"num_bits": self.act_bits, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
