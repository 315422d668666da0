"""Resume an interrupted layer-by-layer calibration from the last finished block.

After each block the store holds: the finished blocks' tensors (integer codes, scales, the
float weights that scale folding changed), the next block's input hidden states, and the
report so far. ``state.json`` is replaced last, by rename, so a kill at any moment leaves
either the previous consistent state or the new one. The state carries a fingerprint of the
model, the recipe and the calibration tokens; a store written for anything else is ignored
and cleared, never resumed. Tensors are safetensors: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from optkit.calibration.capture import BlockInputs
from optkit.quantize.modules import QuantizedLinear
from optkit.quantize.rtn import QuantizedWeight
from optkit.quantize.scheme import QuantScheme

STATE = "state.json"


class ResumeStore:
    def __init__(self, path: Path, fingerprint: str):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.notice: str | None = None  # what happened to an existing store, for the user

    def _state(self) -> dict | None:
        f = self.path / STATE
        if not f.is_file():
            return None
        try:
            return json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def _write_state(self, state: dict) -> None:
        tmp = self.path / f".{STATE}.tmp"
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(tmp, self.path / STATE)

    def get_extra(self, key: str):
        st = self._state()
        if st and st.get("fingerprint") == self.fingerprint:
            return st.get("extra", {}).get(key)
        return None

    def _own_state(self) -> dict:
        """This run's state, or a fresh one (a state written for another run is replaced)."""
        self.path.mkdir(parents=True, exist_ok=True)
        st = self._state()
        if not st or st.get("fingerprint") != self.fingerprint:
            st = {"fingerprint": self.fingerprint, "blocks_done": 0, "blocks": {}, "report": {}, "extra": {}}
        return st

    def put_extra(self, key: str, value) -> None:
        st = self._own_state()
        st.setdefault("extra", {})[key] = value
        self._write_state(st)

    def restore(self, blocks: nn.ModuleList, blocks_name: str, inputs: BlockInputs, report,
                float_inputs: BlockInputs | None = None) -> int:
        """Load finished blocks into ``blocks`` and their last outputs into ``inputs``;
        returns the index of the first block still to do."""
        st = self._state()
        if st is None:
            return 0
        if st.get("fingerprint") != self.fingerprint:
            self.notice = f"ignored resume state at {self.path}: it was written for another model, recipe or calibration set"
            self.clear()
            return 0
        done = int(st["blocks_done"])
        if done == 0:
            return 0
        for i in range(done):
            tensors = load_file(str(self.path / f"block-{i}.safetensors"))
            block = blocks[i]
            for local, sd in st["blocks"][str(i)]["quantized"].items():
                scheme = QuantScheme(**sd)
                qw = QuantizedWeight(
                    tensors[f"{local}.qweight"], tensors[f"{local}.weight_scale"],
                    tensors.get(f"{local}.weight_zero_point"), scheme,
                )
                parent_name, _, child = local.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, child, QuantizedLinear(qw, getattr(parent, child).bias))
            block.load_state_dict(tensors, strict=True)
        hidden = load_file(str(self.path / f"hidden-{done - 1}.safetensors"))
        for i in range(len(inputs)):
            inputs.set_hidden(i, hidden[f"h{i}"])
            if float_inputs is not None:
                float_inputs.set_hidden(i, hidden[f"f{i}"])
        report.layers.update(st["report"].get("layers", {}))
        report.transforms.update(st["report"].get("transforms", {}))
        report.warnings.extend(st["report"].get("warnings", []))
        self.notice = f"resumed from {self.path}: blocks 0-{done - 1} were already quantized"
        return done

    def save(self, i: int, block: nn.Module, prefix: str, inputs: BlockInputs, report,
             float_inputs: BlockInputs | None = None) -> None:
        st = self._own_state()
        sd = {k: v.detach().contiguous() for k, v in block.state_dict().items()}
        save_file(sd, str(self.path / f".block-{i}.tmp"))
        os.replace(self.path / f".block-{i}.tmp", self.path / f"block-{i}.safetensors")
        hidden = {f"h{j}": inputs.hidden(j).contiguous() for j in range(len(inputs))}
        if float_inputs is not None:
            hidden.update({f"f{j}": float_inputs.hidden(j).contiguous() for j in range(len(float_inputs))})
        save_file(hidden, str(self.path / ".hidden.tmp"))
        os.replace(self.path / ".hidden.tmp", self.path / f"hidden-{i}.safetensors")
        quantized = {
            n: {"bits": m.scheme.bits, "group_size": m.scheme.group_size, "symmetric": m.scheme.symmetric,
                "act_bits": m.scheme.act_bits}
            for n, m in block.named_modules() if isinstance(m, QuantizedLinear)
        }
        st["blocks"][str(i)] = {"quantized": quantized}
        st["blocks_done"] = i + 1
        st["report"] = {"layers": report.layers, "transforms": report.transforms, "warnings": report.warnings}
        self._write_state(st)  # the commit point: from here on, blocks_done = i + 1 reads hidden-{i}
        (self.path / f"hidden-{i - 1}.safetensors").unlink(missing_ok=True)

    def clear(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
