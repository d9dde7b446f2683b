"""`grpo config show`: by default the keys most runs set, grouped, one line of doc each; --all every
key; the kinds a list item or section may be (env[] id/dataset blocks, weight_broadcast types)
each labelled, and eval.env[] pointing at env[] rather than repeating it."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from grpo.cli.config_show import FILES, app, render_user_keys
from grpo.config.keys.field_table import field_rows
from grpo.config.keys.user_keys import USER_KEYS
from grpo.config.orchestrator import OrchestratorConfig

runner = CliRunner()


def _show(*args: str) -> str:
    result = runner.invoke(app, ["show", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_default_view_is_short_and_groups_the_keys_users_set_shared_keys_first() -> None:
    text = _show()
    assert len(text.splitlines()) < 150
    headers = [line for line in text.splitlines() if line.startswith("## ")]
    assert headers[0].startswith("## Shared keys") and headers[0].endswith("(rl.yaml)")
    order = ["Shared keys", "Sizes", "Model", "Environments", "Sampling", "Loss"]
    positions = [next(i for i, h in enumerate(headers) if h.startswith(f"## {title}")) for title in order]
    assert positions == sorted(positions)
    assert "grpo config show --all" in text
    for key in (
        "model",
        "max_seq_len",
        "batch_size",
        "rollouts_per_example",
        "loss.kl_beta",
        "env[].reward_funcs",
    ):
        assert re.search(rf"^  {re.escape(key)}: ", text, re.MULTILINE), key


def test_each_key_of_the_default_view_has_one_line_of_doc_under_it() -> None:
    lines = _show().splitlines()
    keys = [i for i, line in enumerate(lines) if re.match(r"^  [a-z_\[\].]+: ", line)]
    assert len(keys) == sum(len(group.keys) for group in USER_KEYS)
    for i in keys:
        doc = lines[i + 1]
        assert doc.startswith("      ") and doc.strip(), lines[i]
        after = lines[i + 2] if i + 2 < len(lines) else ""
        assert len(doc) <= 110 and not after.startswith("      "), lines[i]  # one line, not wrapped


def test_every_key_the_default_view_names_exists_in_its_config() -> None:
    for group in USER_KEYS:
        if group.file is not None:
            keys = {row.key for row in field_rows(group.file, FILES[group.file][0])}
            assert set(group.keys) <= keys, (group.title, set(group.keys) - keys)


def test_one_file_shows_its_own_groups_and_its_names_of_the_shared_keys() -> None:
    text = render_user_keys("orch")
    assert "(train.yaml)" not in text and "(infer.yaml)" not in text
    assert "\n  model.name: " in text and "\n  model.lora_rank: " in text and "\n  max_seq_len: " in text
    assert "\n  batch_size: " in text and "loss.kl_beta" not in text
    assert "grpo config show orch --all" in text


def test_the_env_block_kinds_are_labelled_in_the_default_view() -> None:
    text = _show("orch")
    assert "  [env[] (id block)]\n  env[].id: " in text
    assert "  [env[] (dataset block)]\n  env[].dataset: " in text
    assert "(dataset block) A local" not in text  # the label is the header's, not repeated in each doc


def test_all_prints_every_key_with_each_kind_of_a_section_labelled_once() -> None:
    text = _show("orch", "--all")
    headers = re.findall(r"^\[(.+)\]$", text, re.MULTILINE)
    assert "env[]" not in headers  # no unlabelled env[] header: which block is said
    assert {"env[] (id block)", "env[] (dataset block)", "env[] (any block)"} <= set(headers)
    assert {"weight_broadcast (type: filesystem)", "weight_broadcast (type: nccl)"} <= set(headers)
    assert len(headers) == len(set(headers)), "a section printed twice"
    assert text.count("\n  env[].judge: ") == 1 and text.count("\n  env[].judge.prompt: ") == 1
    assert "  loss.kl_tau" not in text and "  sampling.temperature: " in text


def test_eval_env_points_at_env_instead_of_repeating_it() -> None:
    text = _show("orch", "--all")
    assert "eval.env[]." not in text
    assert re.search(r"eval\.env: .*\n(      .*\n)*.*keys of env\[\] \(above\)", text)


def test_every_field_of_orch_yaml_appears_in_all() -> None:
    rows = field_rows("orch", OrchestratorConfig)
    text = _show("orch", "--all")
    for name in OrchestratorConfig.model_fields:
        assert re.search(rf"^  {name}[:.\[]", text, re.MULTILINE), name
    assert len(text.splitlines()) < 700 and len(rows) > 150
