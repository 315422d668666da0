"""Log-likelihood scoring of multiple-choice tasks, on tiny random Llamas built in code."""

import json
import math
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch

from optkit.errors import UserError
from optkit.evaluate.metrics import LOCAL_METRICS, load_metric
from optkit.evaluate.tasks import (
    BUILTIN_TASKS,
    TaskItem,
    choose,
    encode_pair,
    evaluate_tasks,
    load_task,
    resolve_tasks,
    score_items,
)
from optkit.testing.tiny import tiny_llama, tiny_tokenizer

ITEMS = [
    {"id": "a", "context": "The cat sat on the", "choices": ["mat", "moon", "hat trick"], "answer": 0},
    {"id": "b", "context": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"id": "c", "context": "Q: colour of the sky?\nA:", "choices": ["blue", "green", "loud", "a very long answer"], "answer": 2},
    {"id": "d", "context": "Trailing space here ", "choices": ["x", "yz"], "answer": 1},
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(len(tok), seed=3)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _hand_loglikelihood(model, ctx_ids, cont_ids):
    """Plain loop: one unpadded forward, log_softmax in float64 at each continuation position."""
    with torch.no_grad():
        logits = model(torch.tensor([ctx_ids + cont_ids])).logits[0].double()  # (T, V)
    total = 0.0
    for i, t in enumerate(cont_ids):
        row = logits[len(ctx_ids) - 1 + i]  # the position before token t predicts it
        total += float(row[t] - torch.logsumexp(row, 0))
    return total


def test_scorer_equals_hand_computation(model, tok):
    # batch 3 over 11 (item, choice) rows of different lengths: padding and the batch split are exercised
    preds = score_items(model, tok, [TaskItem(d["id"], d["context"], tuple(d["choices"]), d["answer"]) for d in ITEMS], batch_size=3)
    for item, pred in zip(ITEMS, preds, strict=True):
        context = item["context"].rstrip()
        spaces = item["context"][len(context):] or " "  # lm-eval: " " + choice, or the context's own trailing space
        for choice, got in zip(item["choices"], pred.loglikelihoods, strict=True):
            # the byte-level tokenizer has no merges: the tokens of the joined text are the two parts'
            want = _hand_loglikelihood(model, _ids(tok, context), _ids(tok, spaces + choice))
            assert got == pytest.approx(want, abs=1e-4), (item["id"], choice)
        assert (pred.pred, pred.pred_norm) == choose(pred.loglikelihoods, item["choices"])


def test_encode_pair_moves_the_trailing_space_into_the_continuation(tok):
    assert encode_pair(tok, "The sky is ", "blue") == encode_pair(tok, "The sky is", "blue")
    ctx, cont = encode_pair(tok, "The sky is", "blue")
    assert tok.decode(ctx) == "The sky is" and tok.decode(cont) == " blue"
    ctx, cont = encode_pair(tok, "Answer:", "\n42")  # a choice that brings its own whitespace gets no extra space
    assert tok.decode(cont) == "\n42"


def _letter_argmax(model, tok, ids, letters):
    with torch.no_grad():
        row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)  # (V,)
    scored = sorted(letters, key=lambda ch: float(row[_ids(tok, ch)[0]]), reverse=True)
    return scored[0], scored[-3:]  # the model's favourite letter, and its three least favourite


def test_the_models_own_continuation_is_chosen(model, tok):
    """The right choice is the model's own greedy continuation (over letters); each wrong one
    shares all but its last letter and ends with one of the model's least likely letters, so
    its summed log-likelihood is lower by construction."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    items = []
    for k, context in enumerate(["Once upon a time", "The weather today is", "My favourite food", "In the beginning",
                                 "She opened the door and"]):
        ids = _ids(tok, context + " ")
        cont = ""
        for _ in range(3):
            best, _worst = _letter_argmax(model, tok, ids, letters)
            cont += best
            ids += _ids(tok, best)
        best, worst = _letter_argmax(model, tok, ids, letters)
        right = cont + best
        wrong = [cont + w for w in worst]
        pos = k % 4
        items.append({"id": str(k), "context": context, "choices": wrong[:pos] + [right] + wrong[pos:], "answer": pos})
    res = evaluate_tasks(model, tok, {"greedy": items}, batch_size=4)["greedy"]
    assert [p.pred for p in res.predictions] == [it["answer"] for it in items]
    assert res.accuracy == 1.0 and res.accuracy_norm == 1.0 and res.n == 5


def test_acc_and_acc_norm_differ_on_a_uniform_model(tok):
    """With every next-token distribution uniform, ll = -(tokens) log V: the summed score
    prefers the shortest choice, the per-character score (tokens = chars + 1 for the space)
    the longest."""
    uniform = tiny_llama(len(tok), seed=1)
    with torch.no_grad():
        uniform.model.norm.weight.zero_()  # final hidden state 0 -> all logits 0
    item = {"id": "u", "context": "Pick one:", "choices": ["ab", "abcdefgh", "abcd"], "answer": 1}
    res = evaluate_tasks(uniform, tok, {"u": [item]})["u"]
    (pred,) = res.predictions
    assert pred.loglikelihoods == pytest.approx([-n * math.log(len(tok)) for n in (3, 9, 5)], rel=1e-5)
    assert (pred.pred, pred.pred_norm) == (0, 1)
    assert (res.accuracy, res.accuracy_norm) == (0.0, 1.0)


def test_choose_breaks_ties_toward_the_first_choice():
    assert choose([-1.0, -1.0], ["aa", "bb"]) == (0, 0)
    assert choose([-4.0, -6.0], ["ab", "abcdef"]) == (0, 1)  # -2/char vs -1/char


def test_evaluate_tasks_from_files_names_and_lists(model, tok, tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in ITEMS) + "\n\n")  # blank lines are skipped
    res = evaluate_tasks(model, tok, {"file": path, "builtin": "optkit-cloze", "list": ITEMS}, batch_size=5, max_items=3)
    assert set(res) == {"file", "builtin", "list"}
    assert res["file"].source == str(path) and res["list"].source == "<list>"
    assert res["builtin"].source == str(BUILTIN_TASKS["optkit-cloze"])
    for r in res.values():
        assert r.n == 3 and len(r.predictions) == 3
        assert r.accuracy == pytest.approx(sum(p.pred == p.answer for p in r.predictions) / 3)
        assert r.accuracy_norm == pytest.approx(sum(p.pred_norm == p.answer for p in r.predictions) / 3)
        assert r.accuracy_stderr == pytest.approx(math.sqrt(r.accuracy * (1 - r.accuracy) / 2))
    assert res["file"].predictions[0].loglikelihoods == pytest.approx(res["list"].predictions[0].loglikelihoods, abs=1e-5)
    json.dumps(res["file"].to_json())


GOOD = {"id": "x", "context": "c", "choices": ["a", "b"], "answer": 1}


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "answer"}), "missing key(s) answer"),
        (json.dumps({**GOOD, "label": 1}), "unknown key(s) label"),
        (json.dumps({**GOOD, "answer": 2}), "'answer' 2 is out of range for 2 choices"),
        (json.dumps({**GOOD, "answer": -1}), "out of range"),
        (json.dumps({**GOOD, "answer": True}), "'answer' must be an integer"),
        (json.dumps({**GOOD, "answer": "1"}), "'answer' must be an integer"),
        (json.dumps({**GOOD, "choices": ["only"], "answer": 0}), "at least 2 are needed"),
        (json.dumps({**GOOD, "choices": "ab"}), "'choices' must be a list of strings"),
        (json.dumps({**GOOD, "choices": ["a", " "]}), "non-whitespace"),
        (json.dumps({**GOOD, "choices": ["a", "a"]}), "repeats a choice"),
        (json.dumps({**GOOD, "context": "  "}), "'context' must be a string"),
        (json.dumps({**GOOD, "id": 7}), "'id' must be a non-empty string"),
        (json.dumps({**GOOD, "id": "first"}), "repeats the id at"),
    ],
)
def test_bad_task_files_name_file_and_line(tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    first = json.dumps({**GOOD, "id": "first"})
    path.write_text(f"{first}\n\n{line}\n")  # the bad item is on line 3
    with pytest.raises(UserError) as err:
        load_task(path)
    msg = str(err.value)
    assert f"{path} line 3" in msg and fragment in msg, msg


def test_empty_missing_and_undecodable_task_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n \n")
    with pytest.raises(UserError, match="holds no items"):
        load_task(empty)
    with pytest.raises(UserError, match="not found"):
        load_task(tmp_path / "nope.jsonl")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError, match="not UTF-8"):
        load_task(binary)
    with pytest.raises(UserError, match="neither a built-in task nor an existing file"):
        evaluate_tasks(None, None, {"t": "optkit-nonexistent"})


def test_bad_items_in_a_list_name_the_item():
    with pytest.raises(UserError, match=r"task 'mine' item 1: .*out of range"):
        evaluate_tasks(None, None, {"mine": [GOOD, {**GOOD, "id": "y", "answer": 5}]})
    with pytest.raises(UserError, match="holds no items"):
        evaluate_tasks(None, None, {"mine": []})


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_shipped_tasks_are_valid(name):
    items = load_task(BUILTIN_TASKS[name])
    assert len(items) >= 30
    assert all(len(it.choices) == 4 and 0 <= it.answer < 4 for it in items)
    positions = Counter(it.answer for it in items)
    assert set(positions) == {0, 1, 2, 3} and min(positions.values()) >= len(items) // 4 - 1  # balanced
    assert len({it.context for it in items}) == len(items)  # no duplicated questions
    for it in items:  # lm-eval's joining convention: no trailing space on the context, none leading the choices
        assert it.context == it.context.rstrip() and all(c == c.strip() for c in it.choices), it.id


def test_local_accuracy_metric_loads_offline_in_a_fresh_hf_home(tmp_path):
    home = tmp_path / "fresh-hf-home"
    script = textwrap.dedent(
        """
        import json, sys, evaluate
        m = evaluate.load(sys.argv[1], keep_in_memory=True)
        assert isinstance(m, evaluate.Metric), type(m)
        r = m.compute(predictions=[0, 1, 2, 3], references=[0, 1, 1, 3])
        w = m.compute(predictions=[0, 1], references=[0, 0], sample_weight=[3.0, 1.0], normalize=False)
        print(json.dumps([r, w]))
        """
    )
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"}
    env.pop("HF_MODULES_CACHE", None)
    done = subprocess.run([sys.executable, "-c", script, str(LOCAL_METRICS["accuracy"])], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [{"accuracy": 0.75}, {"accuracy": 3.0}]
    assert list((home / "modules").rglob("accuracy.py")), "evaluate should import the module from the fresh HF_HOME"


def test_load_metric_in_process_and_unknown_name():
    m = load_metric("accuracy")
    assert m.compute(predictions=[1, 1, 0], references=[1, 0, 0])["accuracy"] == pytest.approx(2 / 3)
    assert m.compute(predictions=[], references=[])["accuracy"] == 0.0
    with pytest.raises(UserError, match="optkit ships: accuracy"):
        load_metric("bleu")


def test_resolve_tasks_validates_up_front_and_names_files_by_stem(tmp_path):
    mine = tmp_path / "my-qa.jsonl"
    mine.write_text(json.dumps(GOOD) + "\n")
    assert resolve_tasks(["optkit-facts", str(mine)]) == {"optkit-facts": BUILTIN_TASKS["optkit-facts"], "my-qa": mine}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**GOOD, "answer": 9}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl line 1: .*out of range"):
        resolve_tasks(["optkit-cloze", str(bad)])
    (tmp_path / "sub").mkdir()
    twin = tmp_path / "sub" / "my-qa.jsonl"
    twin.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(UserError, match="two tasks are named 'my-qa'"):
        resolve_tasks([mine, twin])
