import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from optkit.calibration import build_calibration, builtin_dir
from optkit.errors import CalibrationError
from optkit.recipe import CalibrationConfig

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"question {i} " * 20}, {"role": "assistant", "content": f"answer {i} " * 20}]}
    for i in range(12)
]


def _cfg(source, **kw):
    return CalibrationConfig(source=str(source), **{"num_samples": 4, "seq_len": 64, **kw})


def test_same_inputs_same_tokens_and_fingerprint(small_calib, tokenizer):
    a = build_calibration(_cfg(small_calib), tokenizer)
    b = build_calibration(_cfg(small_calib), tokenizer)
    assert a.input_ids.shape == (4, 64) and a.input_ids.dtype == torch.int64
    assert torch.equal(a.input_ids, b.input_ids) and a.fingerprint == b.fingerprint
    c = build_calibration(_cfg(small_calib, seed=1), tokenizer)
    assert not torch.equal(a.input_ids, c.input_ids) and a.fingerprint != c.fingerprint


def test_windows_are_real_token_spans(small_calib, tokenizer):
    cal = build_calibration(_cfg(small_calib, num_samples=3, seq_len=32), tokenizer)
    stream = tokenizer(small_calib.read_text(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for row in cal.input_ids.tolist():
        starts = [i for i in range(0, len(stream) - 31, 32) if stream[i : i + 32] == row]
        assert starts, "each window is a non-overlapping 32-token slice of the stream"


def test_jsonl_parquet_and_hf_dataset_sources_agree(tmp_path, tokenizer):
    texts = [f"document number {i}: " + "lorem ipsum dolor sit amet " * 8 for i in range(30)]
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"body": t}) for t in texts) + "\n")
    pdir = tmp_path / "ds"
    pdir.mkdir()
    pq.write_table(pa.table({"body": texts}), pdir / "train.parquet")
    a = build_calibration(_cfg(jl, text_field="body"), tokenizer)
    b = build_calibration(_cfg(pdir / "train.parquet", text_field="body"), tokenizer)
    c = build_calibration(_cfg(f"hf:{pdir}", text_field="body"), tokenizer)
    assert a.fingerprint == b.fingerprint == c.fingerprint
    assert a.info["documents"] == 30


def test_chat_template_wraps_conversations(tmp_path, tokenizer):
    jl = tmp_path / "chat.jsonl"
    jl.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS))
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # 70 windows of 64 tokens cover nearly all of the ~5k-token stream, so every turn marker is in it
    auto = build_calibration(_cfg(jl, num_samples=70), tokenizer)
    off = build_calibration(_cfg(jl, num_samples=70, chat_template="off"), tokenizer)
    assert auto.info["chat_template"] and (auto.input_ids == im_start).any()
    assert not off.info["chat_template"] and not (off.input_ids == im_start).any()
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        with pytest.raises(CalibrationError, match="chat_template is 'on' but the tokenizer has no chat template"):
            build_calibration(_cfg(jl, chat_template="on"), tokenizer)
    finally:
        tokenizer.chat_template = saved


def test_not_enough_tokens_says_how_many(small_calib, tokenizer):
    with pytest.raises(CalibrationError, match=r"holds \d+ tokens: \d+ windows of 4096, fewer than num_samples=64"):
        build_calibration(_cfg(small_calib, num_samples=64, seq_len=4096), tokenizer)


def test_bad_records(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(CalibrationError, match=r"bad.jsonl:2: not valid JSON"):
        build_calibration(_cfg(bad), tokenizer)
    bad.write_text('{"content": "no text key"}\n')
    with pytest.raises(CalibrationError, match=r"no string 'text' field .*keys: content"):
        build_calibration(_cfg(bad), tokenizer)
    with pytest.raises(CalibrationError, match="not found"):
        build_calibration(_cfg(tmp_path / "nope.txt"), tokenizer)
    other = tmp_path / "x.csv"
    other.write_text("a,b")
    with pytest.raises(CalibrationError, match=r"unsupported calibration file type '.csv'; allowed: .txt, .raw, .tokens, .jsonl, .parquet"):
        build_calibration(_cfg(other), tokenizer)


def test_builtin_set_is_varied(tokenizer):
    cats = {}
    for f in builtin_dir().glob("*.jsonl"):
        for line in f.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            cats[rec["category"]] = cats.get(rec["category"], 0) + 1
    assert set(cats) >= {"prose", "dialogue", "code", "structured", "multilingual"}
    assert all(n >= 30 for n in cats.values()), cats
    cal = build_calibration(CalibrationConfig(num_samples=16, seq_len=256), tokenizer)
    assert cal.info["conversations"] > 0 and cal.info["chat_template"]
