"""``model.tokenizer_class``: loading the class AutoTokenizer chose gives the same tokenizer,
without the torch import; a wrong name is refused by name; ``splitrl up`` pins the class."""

from __future__ import annotations

import pytest
import yaml

from splitrl import tokenizer as tk
from splitrl.init_model import init_model
from tests.fresh_python import python_prints

TEXTS = ["3+4=", "What is 12 + 7?", "It costs $1,234.50 in 2024.", "  spaced\n\nlines\t!",
         "<|im_start|>user\nhi<|im_end|>", "éàü 漢字 🙂"]


@pytest.fixture(scope="module", params=[("qwen2", "arithmetic"), ("qwen3", "default"),
                                        ("llama", "default")])
def model_dir(request, tmp_path_factory, shared_data):
    family, vocab = request.param
    return init_model(tmp_path_factory.mktemp(family) / "m", family=family, preset="tiny",
                      vocab=vocab, data_dir=shared_data)


def test_the_class_autotokenizer_chose_loads_the_same_tokenizer(model_dir):
    auto = tk.load_tokenizer(model_dir)
    name = tk.exported_class_name(auto)
    assert name is not None
    named = tk.load_tokenizer(model_dir, name)
    assert type(named) is type(auto)
    for text in TEXTS:
        ids = auto.encode(text, add_special_tokens=False)
        assert named.encode(text, add_special_tokens=False) == ids
        assert tk.decode(named, ids) == tk.decode(auto, ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    assert (tk.render_prompt(named, messages=messages) == tk.render_prompt(auto, messages=messages))
    assert tk.eos_token_ids(named) == tk.eos_token_ids(auto)
    assert (named.pad_token_id, len(named)) == (auto.pad_token_id, len(auto))


def test_a_named_class_loads_without_importing_torch(model_dir):
    name = tk.exported_class_name(tk.load_tokenizer(model_dir))
    code = ("import sys\n"
            "from splitrl.tokenizer import load_tokenizer\n"
            f"tok = load_tokenizer({str(model_dir)!r}, {name!r})\n"
            "assert tok.encode('3+4=', add_special_tokens=False)\n"
            "print('torch' in sys.modules)\n")
    assert python_prints(code) == ["False"]


@pytest.mark.parametrize("name", ["NoSuchTokenizer", "Qwen2Config", "not a name", "__class__"])
def test_a_name_that_is_no_tokenizer_class_is_refused_by_name(arith_model, name):
    with pytest.raises(ValueError, match=rf"model.tokenizer_class: .*got {name!r}"):
        tk.load_tokenizer(arith_model, name)


def test_the_launcher_pins_the_class_in_the_launch_config(arith_model, tmp_path):
    from splitrl_app.launch.supervisor import Launcher
    from tests.e2e.harness import run_config

    launcher = Launcher(run_config(arith_model, tmp_path / "run"))
    launched = yaml.safe_load(launcher.config_path.read_text())
    assert launched["model"]["tokenizer_class"] == type(tk.load_tokenizer(arith_model)).__name__

    chosen = run_config(arith_model, tmp_path / "run2", "model.tokenizer_class=TokenizersBackend")
    launched = yaml.safe_load(Launcher(chosen).config_path.read_text())
    assert launched["model"]["tokenizer_class"] == "TokenizersBackend"  # the user's choice stays


def test_the_chosen_class_is_remembered_so_the_next_launch_skips_torch(arith_model, tmp_path,
                                                                      monkeypatch):
    from splitrl_app.launch.tokenizer_class import pin_tokenizer_class
    from tests.e2e.harness import run_config

    monkeypatch.setenv("SPLITRL_CACHE_DIR", str(tmp_path / "cache"))
    assert tk.remembered_tokenizer_class(arith_model) is None
    cfg = run_config(arith_model, tmp_path / "run")
    assert pin_tokenizer_class(cfg) is not None  # resolved by AutoTokenizer: it loaded one
    chosen = cfg.model.tokenizer_class
    assert tk.remembered_tokenizer_class(arith_model) == chosen
    # A new launcher process pins the same class without importing torch.
    code = ("import sys\n"
            "from tests.e2e.harness import run_config\n"
            "from splitrl_app.launch.tokenizer_class import pin_tokenizer_class\n"
            f"cfg = run_config({str(arith_model)!r}, {str(tmp_path / 'run2')!r})\n"
            "assert pin_tokenizer_class(cfg) is None\n"
            "print(cfg.model.tokenizer_class, 'torch' in sys.modules)\n")
    assert python_prints(code) == [f"{chosen} False"]
    # Other tokenizer files (or another transformers) are another key: resolved again.
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in arith_model.iterdir():
        if f.is_file():
            (edited / f.name).write_bytes(f.read_bytes())
    config = edited / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"padding_side": "left"',
                                                 '"padding_side": "right"'))
    assert tk.remembered_tokenizer_class(edited) is None
    pin_tokenizer_class(run_config(edited, tmp_path / "run3"))
    assert tk.remembered_tokenizer_class(edited) == chosen
    (edited / "vocab.json").write_text("{}")  # another file AutoTokenizer may look at
    assert tk.remembered_tokenizer_class(edited) is None
