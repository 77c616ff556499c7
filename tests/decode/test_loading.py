"""Loading checks every drafter file it reads: clear errors naming the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draftsmith.decode import loading
from draftsmith.decode.drafters.medusa import MedusaHeads
from draftsmith.decode.drafters.registry import detect_drafter_kind, load_drafter
from draftsmith.decode.loading import LoadError
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny_pair, tiny_llama


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def medusa_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "medusa"
    MedusaHeads.from_target(tiny_llama(), num_heads=2, num_layers=1).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"format_version": 1}', r"drafter\.json declares no drafter kind.*add it, or re-export"),
        ('{"kind": "medusa", ', r"drafter\.json is not valid JSON.*re-export the drafter"),
        ('["medusa"]', r"drafter\.json holds a JSON list, not an object"),
        ('{"kind": 3}', r"declares no drafter kind"),
        ('{"kind": "medusa", "format_version": 999}', r"format_version 999 is newer.*upgrade"),
        ('{"kind": "medusa", "format_version": "1"}', r"format_version must be a positive int"),
    ],
    ids=["no-kind", "malformed", "not-an-object", "kind-not-a-string", "too-new", "bad-version"],
)
def test_a_bad_drafter_json_is_named(medusa_folder: Path, text: str, expected: str) -> None:
    (medusa_folder / "drafter.json").write_text(text)
    with pytest.raises(LoadError, match=expected) as error:
        detect_drafter_kind(medusa_folder)
    assert str(medusa_folder / "drafter.json") in str(error.value)
    with pytest.raises(LoadError, match=expected):
        MedusaHeads.from_pretrained(medusa_folder)


@pytest.mark.parametrize("broken", ["folder", "dangling link"])
def test_a_drafter_json_that_is_not_a_file_is_named(medusa_folder: Path, broken: str) -> None:
    """Not read as a folder without a marker (which would load it as a draft LM)."""
    marker = medusa_folder / "drafter.json"
    marker.unlink()
    if broken == "folder":
        marker.mkdir()
    else:
        marker.symlink_to(medusa_folder / "missing.json")
    with pytest.raises(loading.LoadError, match=r"drafter\.json is not a readable file"):
        detect_drafter_kind(medusa_folder)


def test_a_drafter_path_that_is_a_file_is_named(medusa_folder: Path) -> None:
    weights = medusa_folder / "model.safetensors"
    with pytest.raises(ValueError, match=r"model\.safetensors is a file, not a drafter folder"):
        detect_drafter_kind(weights)
    with pytest.raises(ValueError, match="is a file, not a drafter folder"):
        load_drafter(weights, tiny_llama())


def test_a_malformed_config_json_is_named(medusa_folder: Path) -> None:
    (medusa_folder / "config.json").write_text("{oops")
    with pytest.raises(LoadError, match=r"config\.json is not valid JSON"):
        MedusaHeads.from_pretrained(medusa_folder)
    (medusa_folder / "drafter.json").unlink()
    with pytest.raises(LoadError, match=r"config\.json is not valid JSON"):
        detect_drafter_kind(medusa_folder)


def test_non_finite_head_weights_are_refused(medusa_folder: Path) -> None:
    weights = load_file(str(medusa_folder / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(medusa_folder / "model.safetensors"))
    with pytest.raises(LoadError, match=rf"model\.safetensors: weight {name} holds 1 NaN"):
        MedusaHeads.from_pretrained(medusa_folder)


def test_a_corrupt_safetensors_file_is_named(medusa_folder: Path) -> None:
    weights = medusa_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated by a failed copy, say
    with pytest.raises(LoadError, match=r"model\.safetensors is not a readable safetensors file"):
        MedusaHeads.from_pretrained(medusa_folder)


def test_a_draft_lm_with_nan_weights_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target_dir, draft_dir = pair
    target = loading.load_causal_lm(target_dir)
    bad = tmp_path / "draft"
    model = loading.load_causal_lm(draft_dir, frozen=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[3, 0] = float("inf")
    model.save_pretrained(bad)
    (bad / "drafter.json").write_text(json.dumps({"kind": "draft_lm", "format_version": 1}))
    with pytest.raises(LoadError, match=rf"--drafter {bad}: weight .*embed_tokens.* 1 NaN or inf"):
        load_drafter(bad, target)
    assert load_drafter(draft_dir, target).kind == "draft_lm"  # the untouched folder loads


def test_pickled_weights_are_never_loaded(pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, draft_dir = pair
    model = loading.load_causal_lm(draft_dir)
    pickled = tmp_path / "pickled"
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"only pickled \.bin weights, which are never"):
        loading.load_causal_lm(pickled, flag="--drafter")


def test_dtype_names_come_from_one_table() -> None:
    from draftsmith.decode.precision import choose_dtype

    assert loading.resolve_dtype("bfloat16") is torch.bfloat16
    assert loading.resolve_dtype("auto") is choose_dtype("auto").dtype
    assert loading.resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(
        ValueError, match="--dtype 'fp32' is not valid; choose one of auto, float32"
    ):
        loading.resolve_dtype("fp32")


# ---- hostile config.json values and weights of a head folder


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("hidden_size", "32", r"MedusaConfig\.hidden_size must be an integer, got '32'"),
        ("bias", "yes", r"MedusaConfig\.bias must be true or false, got 'yes'"),
        ("bias", [1], r"MedusaConfig\.bias must be true or false"),
        ("num_heads", 10**7, r"num_heads 10000000 is larger than every dimension"),
        ("hidden_size", 10**7, r"hidden_size 10000000 is larger than every dimension"),
    ],
)
def test_a_bad_medusa_config_value_is_named(
    medusa_folder: Path, field: str, value: object, expected: str
) -> None:
    """Huge sizes used to allocate before the shapes were compared (an OOM kill at 10**7
    heads); a wrong type was accepted (bias "yes") or crashed inside torch."""
    config = json.loads((medusa_folder / "config.json").read_text())
    config[field] = value
    (medusa_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=expected):
        MedusaHeads.from_pretrained(medusa_folder)


@pytest.fixture
def eagle_folder(tmp_path: Path) -> Path:
    from draftsmith.decode.drafters.eagle.head import Eagle3Config, Eagle3Head

    folder = tmp_path / "eagle3"
    Eagle3Head(Eagle3Config.for_target(tiny_llama().config)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("intermediate_size", "64", r"Eagle3Config\.intermediate_size must be an integer"),
        ("num_key_value_heads", 0, r"Eagle3Config\.num_key_value_heads must be positive"),
        ("num_attention_heads", None, r"num_attention_heads must be an integer, got null"),
        ("aux_hidden_state_layer_ids", 1, r"aux_hidden_state_layer_ids must be a list of int"),
        ("rms_norm_eps", "abc", r"Eagle3Config\.rms_norm_eps must be a finite number"),
        ("rope_theta", -1, r"Eagle3Config\.rope_theta must be positive, got -1\.0"),
        ("max_position_embeddings", 1.5, r"max_position_embeddings must be an integer"),
        ("intermediate_size", 10**8, r"intermediate_size 100000000 is larger than every"),
    ],
)
def test_a_bad_eagle3_config_value_is_named(
    eagle_folder: Path, field: str, value: object, expected: str
) -> None:
    """These used to raise TypeError/RuntimeError/ZeroDivisionError from inside torch, or be
    accepted (a string rms_norm_eps, a negative rope_theta)."""
    from draftsmith.decode.drafters.eagle.head import Eagle3Head

    config = json.loads((eagle_folder / "config.json").read_text())
    config[field] = value
    (eagle_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=expected):
        Eagle3Head.from_pretrained(eagle_folder)


def test_integer_weights_are_refused(medusa_folder: Path) -> None:
    weights = load_file(str(medusa_folder / "model.safetensors"))
    weights = {name: tensor.to(torch.int32) for name, tensor in weights.items()}
    save_file(weights, str(medusa_folder / "model.safetensors"))
    with pytest.raises(LoadError, match=r"has dtype int32, not a floating-point dtype"):
        MedusaHeads.from_pretrained(medusa_folder)


def test_a_valid_head_folder_still_round_trips(eagle_folder: Path) -> None:
    from draftsmith.decode.drafters.eagle.head import Eagle3Head

    head = Eagle3Head.from_pretrained(eagle_folder)
    assert head.config.aux_hidden_state_layer_ids == (0, 1)


ENGINE_EAGLE3 = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": 96,
    "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"hidden_size": "32"}, r"hidden_size must be an integer"),
        ({"intermediate_size": -64}, r"intermediate_size must be positive"),
        ({"rms_norm_eps": "abc"}, r"rms_norm_eps must be"),
        ({"eagle_aux_hidden_state_layer_ids": "1,2"}, r"must be a list of integers"),
        ({"eagle_aux_hidden_state_layer_ids": None, "eagle_config": [1]}, r"must be an object"),
        ({"vocab_size": None}, r"target_vocab_size must be an integer"),
    ],
)
def test_engine_eagle3_config_values_are_checked(change: dict, expected: str) -> None:
    """A vLLM/SGLang EAGLE-3 export's config.json gets the checks of our own folders."""
    from draftsmith.decode.drafters.eagle.config import config_from_engine_dict

    config_from_engine_dict(ENGINE_EAGLE3, 4)  # the unchanged export reads
    with pytest.raises(loading.LoadError, match=expected):
        config_from_engine_dict({**ENGINE_EAGLE3, **change}, 4)


def test_engine_eagle3_config_missing_keys_are_named() -> None:
    from draftsmith.decode.drafters.eagle.config import config_from_engine_dict

    raw = {k: v for k, v in ENGINE_EAGLE3.items() if k != "intermediate_size"}
    with pytest.raises(loading.LoadError, match=r"lacks intermediate_size"):
        config_from_engine_dict(raw, 4)
