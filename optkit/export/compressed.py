"""The compressed-tensors ``pack-quantized`` layout: what vLLM, SGLang and transformers load.

Per quantized module ``M`` the safetensors file holds:

- ``M.weight_packed``: int32 ``(out, ceil(in * bits / 32))``: signed codes + 2^(bits-1),
  packed densely along the input dimension;
- ``M.weight_scale``: ``(out, n_groups)`` in the model dtype;
- ``M.weight_zero_point``: int32 ``(ceil(out * bits / 32), n_groups)``, packed along the
  output dimension (asymmetric only);
- ``M.weight_shape``: int64 ``[out, in]``.

Packing itself is compressed-tensors' own ``pack_to_int32`` / ``unpack_from_int32``: the
format belongs to that library, so we use its definition rather than a copy.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme

FORMAT = "pack-quantized"
#: W8A8 (int8 weights and int8 activations): codes stored as int8 ``M.weight`` (out, in) with
#: ``M.weight_scale`` (out, 1); the config's ``input_activations`` tells runtimes to quantize
#: the inputs per token at run time (vLLM's int8 GEMM path).
INT_FORMAT = "int-quantized"
STORED_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight")


def format_of(scheme: QuantScheme) -> str:
    return INT_FORMAT if scheme.act_bits is not None else FORMAT


def pack_weight(qw: QuantizedWeight, prefix: str) -> dict[str, torch.Tensor]:
    bits = qw.scheme.bits
    if format_of(qw.scheme) == INT_FORMAT:
        out = {f"{prefix}weight": qw.q.contiguous(), f"{prefix}weight_scale": qw.scale.contiguous()}
        if qw.zero_point is not None:
            out[f"{prefix}weight_zero_point"] = qw.zero_point.contiguous()
        return out
    out = {
        f"{prefix}weight_packed": pack_to_int32(qw.q, bits),
        f"{prefix}weight_scale": qw.scale.contiguous(),
        f"{prefix}weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int64),
    }
    if qw.zero_point is not None:
        out[f"{prefix}weight_zero_point"] = pack_to_int32(qw.zero_point, bits, packed_dim=0)
    return out


def unpack_weight(tensors: dict[str, torch.Tensor], prefix: str, scheme: QuantScheme) -> QuantizedWeight:
    if format_of(scheme) == INT_FORMAT:
        return QuantizedWeight(
            tensors[f"{prefix}weight"].to(torch.int8), tensors[f"{prefix}weight_scale"],
            tensors.get(f"{prefix}weight_zero_point"), scheme,
        )
    shape = torch.Size(tensors[f"{prefix}weight_shape"].tolist())
    scale = tensors[f"{prefix}weight_scale"]
    q = unpack_from_int32(tensors[f"{prefix}weight_packed"], scheme.bits, shape)
    zp = None
    if not scheme.symmetric:
        zp_shape = torch.Size([shape[0], scale.shape[-1]])
        zp = unpack_from_int32(tensors[f"{prefix}weight_zero_point"], scheme.bits, zp_shape, packed_dim=0)
    return QuantizedWeight(q, scale, zp, scheme)


def quantization_config(
    groups: dict[QuantScheme, list[str]], ignore: list[str], linear_names: set[str], actorder: bool = False
) -> dict:
    """A compressed-tensors ``quantization_config`` (validated by the library's own schema).

    A single scheme over all quantized Linear layers targets the class ``Linear`` with an
    ``ignore`` list (what llm-compressor writes); otherwise each group lists exact names.
    """
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    config_groups = {}
    linear_groups = [s for s, names in groups.items() if set(names) <= linear_names]
    for i, (scheme, names) in enumerate(sorted(groups.items(), key=lambda kv: kv[0].label())):
        only_linear_group = len(linear_groups) == 1 and scheme in linear_groups
        targets = ["Linear"] if only_linear_group else sorted(names)
        config_groups[f"group_{i}"] = QuantizationScheme(
            targets=targets,
            weights=scheme.to_compressed_tensors(actorder=actorder and scheme.group_size is not None),
            input_activations=scheme.input_activations_compressed_tensors(),
            format=format_of(scheme),
        )
    formats = {format_of(s) for s in groups}
    cfg = QuantizationConfig(
        config_groups=config_groups,
        quant_method="compressed-tensors",
        format=formats.pop() if len(formats) == 1 else "mixed-precision",
        quantization_status="compressed",
        ignore=sorted(ignore),
    )
    return cfg.to_dict()
