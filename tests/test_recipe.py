import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from optkit.errors import RecipeError
from optkit.quantize.scheme import QuantScheme
from optkit.recipe import Recipe, load_recipe, recipe_from_dict, recipe_json_schema

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_defaults():
    r = Recipe()
    assert r.model.source == "default" and not r.model.trust_remote_code and not r.model.allow_pickle
    assert r.quantization.weight_scheme() == QuantScheme(4, 128, True)
    assert recipe_from_dict({"quantization": {"scheme": "w8a16"}}).quantization.weight_scheme() == QuantScheme(8, None, True)


def test_unknown_key_names_file_path_and_allowed(tmp_path):
    p = _write(tmp_path, "quantization:\n  scheme: w4a16\n  grup_size: 64\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    msg = str(exc.value)
    assert f"{p}: quantization.grup_size: unknown key" in msg
    assert "group_size" in msg  # the allowed keys are listed


def test_wrong_type_and_unknown_scheme(tmp_path):
    with pytest.raises(RecipeError, match=r"calibration\.num_samples: .*\(got: 'many'\)"):
        load_recipe(_write(tmp_path, "calibration:\n  num_samples: many\n"))
    with pytest.raises(RecipeError, match=r"quantization\.scheme: Input should be 'w8a16', 'w4a16' or 'w8a8' \(got: 'w3a16'\)"):
        load_recipe(_write(tmp_path, "quantization:\n  scheme: w3a16\n"))
    with pytest.raises(RecipeError, match=r"group_size 48 is not supported; allowed: 32, 64, 128, 256 or 'channel'"):
        load_recipe(_write(tmp_path, "quantization:\n  group_size: 48\n"))


def test_yaml_problems(tmp_path):
    with pytest.raises(RecipeError, match="duplicate key 'scheme'"):
        load_recipe(_write(tmp_path, "quantization:\n  scheme: w4a16\n  scheme: w8a16\n"))
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(_write(tmp_path, "quantization: [unclosed\n"))
    with pytest.raises(RecipeError, match="must be a mapping"):
        load_recipe(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")


def test_shipped_recipes_validate_and_match_the_published_schema():
    assert {p.name for p in RECIPES} >= {"smollm2-w8a16.yaml", "smollm2-w4a16-g64.yaml"}
    schema = recipe_json_schema()
    json.dumps(schema)
    for p in RECIPES:
        load_recipe(p)
        jsonschema.validate(yaml.safe_load(p.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"quantization": {"bogus": 1}}, schema)


def test_committed_schema_is_current():
    committed = json.loads((Path(__file__).resolve().parents[1] / "recipe.schema.json").read_text())
    assert committed == recipe_json_schema(), "run: optkit schema --out recipe.schema.json"
