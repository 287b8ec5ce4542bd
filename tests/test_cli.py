"""Bad input on the command line: one line that names the input and the fix, exit status 2, no traceback."""

import json

import pytest

from residualkv.backbones import BackboneError, load_backbone
from residualkv.cli import main


@pytest.fixture(autouse=True)
def _own_data_dir(tmp_path, monkeypatch):
    """Whatever a command would write (packed data, an MLflow store) goes to the test's folder."""
    monkeypatch.setenv("RKV_DATA_DIR", str(tmp_path / "data"))


def _fails_cleanly(argv, capsys, *expected):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"rkv {argv[0]}: ")
    for text in expected:
        assert text in err, err


def test_unknown_profile_is_named_before_any_prefect_server_starts(capsys):
    _fails_cleanly(["run", "--profile", "no-such-profile"], capsys, "unknown pipeline profile 'no-such-profile'",
                   "known: ")
    assert "temporary server" not in capsys.readouterr().err
    _fails_cleanly(["deploy", "--profile", "no-such-profile"], capsys, "unknown pipeline profile")


def test_every_shipped_profile_passes_its_own_checks():
    """The weekly job's profile runs only at its cron: a bad method name or setting in it must fail here."""
    from flows.profiles import load_profile
    from residualkv.paths import configs_dir

    shipped = sorted((configs_dir() / "pipelines").glob("*.yaml"))
    assert {p.stem for p in shipped} >= {"default", "quick", "smoke"}
    for path in shipped:
        profile = load_profile(path)
        assert profile.name == path.stem
        assert profile.registry["method"] in profile.evaluate["methods"]


def test_a_profile_with_an_invalid_training_setting_fails_before_the_pipeline_starts(tmp_path, capsys):
    import yaml

    from residualkv.paths import configs_dir

    profile = yaml.safe_load((configs_dir() / "pipelines" / "smoke.yaml").read_text())
    profile["train"]["lr"] = -1.0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(profile))
    _fails_cleanly(["run", "--profile", str(bad)], capsys, f"{bad}: train: invalid lr=-1.0")
    profile["train"]["lr"], profile["train"]["bf16"] = 2e-4, "yes"
    bad.write_text(yaml.safe_dump(profile))
    _fails_cleanly(["run", "--profile", str(bad)], capsys, f"{bad}: train: invalid bf16='yes'", '"auto"')
    del profile["train"]["bf16"]

    # evaluation options and promotion values are read after training: they are checked here too
    profile["train"]["lr"] = 2e-4
    profile["evaluate"]["options"]["n_sampels"] = 3
    bad.write_text(yaml.safe_dump(profile))
    _fails_cleanly(["run", "--profile", str(bad)], capsys, "unknown key(s) ['n_sampels'] in `evaluate.options`",
                   "'n_samples'")
    del profile["evaluate"]["options"]["n_sampels"]
    profile.setdefault("registry", {})["promotion"] = {"score_tol": "0.01x"}
    bad.write_text(yaml.safe_dump(profile))
    _fails_cleanly(["run", "--profile", str(bad)], capsys, "registry.promotion.score_tol is '0.01x'; it must be a number")

    # and what only the end of a run or the deployment's server would read
    original = yaml.safe_load((configs_dir() / "pipelines" / "smoke.yaml").read_text())
    for section, change, expected in [
        ("registry", {"model_name": "rkv-{backbon}"}, "registry.model_name 'rkv-{backbon}' cannot be formatted"),
        ("registry", {"model_name": "rkv-{backbone.x}"}, "registry.model_name 'rkv-{backbone.x}' cannot be formatted"),
        ("schedule", {"timezone": 5}, "schedule.timezone 5 is not an IANA time zone"),
        ("registry", {"promotion": {"score_metric": "ppl_rell"}}, "registry.promotion.score_metric 'ppl_rell' is not a metric"),
        ("schedule", {"cron": "0 3 * *"}, "schedule.cron '0 3 * *'"),
        ("schedule", {"timezone": "Mars/Base"}, "schedule.timezone 'Mars/Base' is not an IANA time zone"),
        ("accounting", {"context_lens": 2048}, "accounting.context_lens is 2048; it must be a list"),
        ("throughput", {"repeats": 0}, "throughput.repeats is 0; it must be a positive integer"),
        ("throughput", {"methods": ["full", "residualkv-r9x"]},
         "unknown method(s) ['residualkv-r9x'] in `throughput.methods`; known: full"),
    ]:
        profile = yaml.safe_load(yaml.safe_dump(original))
        for key, value in change.items():
            if isinstance(value, dict):
                profile[section][key].update(value)
            else:
                profile[section][key] = value
        bad.write_text(yaml.safe_dump(profile))
        _fails_cleanly(["run", "--profile", str(bad)], capsys, expected)
    for metric in ("rel_score_ctx2048", "task.niah_single", "decode_tok_s_ctx1024", "ppl_rel"):
        from tasks.tracking import known_metric

        assert known_metric(metric), metric
    bad.write_text("name: broken\nbackbones: [a\n")
    _fails_cleanly(["run", "--profile", str(bad)], capsys, f"{bad}: not valid YAML at line")


def test_missing_or_malformed_task_files_name_the_file_and_line(tmp_path, capsys):
    out = str(tmp_path / "eval.json")
    _fails_cleanly(["eval", "--methods", "full", "--tasks", str(tmp_path / "missing.jsonl"), "--json", out], capsys,
                   "no task file at", '"id", "context", "question" and "answers"')
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "context": "c", "question": "q", "answers": ["x"]}) + "\n"
                   + json.dumps({"id": "b", "context": "c"}) + "\n")
    _fails_cleanly(["eval", "--methods", "full", "--tasks", str(bad), "--json", out], capsys,
                   f"{bad}:2: missing field(s) ['question', 'answers']")
    bad.write_text("{not json\n")
    _fails_cleanly(["eval", "--methods", "full", "--tasks", str(bad), "--json", out], capsys,
                   f"{bad}:1 is not valid JSON")


def test_an_unknown_suite_lists_the_known_ones(tmp_path, capsys):
    _fails_cleanly(["eval", "--methods", "full", "--suite", "nosuch", "--json", str(tmp_path / "e.json")], capsys,
                   "unknown suite 'nosuch'", "synthetic", "ppl")


def test_invalid_training_settings_say_the_fix(tmp_path, capsys):
    _fails_cleanly(["train", "--backbone", "smollm2-135m", "--lr", "-1", "--steps", "1", "--out", str(tmp_path / "c")],
                   capsys, "invalid lr=-1.0", "positive learning rate")


@pytest.mark.parametrize("argv,flag", [
    (["accounting", "--context-len", "0"], "--context-len: needs at least 16 tokens, got 0"),
    (["eval", "--methods", "full", "--n-samples", "-1", "--json", "x.json"], "--n-samples: needs at least 1 samples"),
    (["eval", "--methods", "full", "--threads", "0", "--json", "x.json"], "--threads: needs at least 1 threads"),
    (["train", "--stride", "0", "--steps", "1"], "--stride: needs at least 1 tokens, got 0"),  # was silently the default
    (["train", "--d-c", "-5", "--steps", "1"], "--d-c: needs at least 1 dimensions"),
    (["generate", "hi", "--max-new-tokens", "x"], "--max-new-tokens: expected an integer number of tokens, got 'x'"),
    (["train", "--bf16", "yes", "--steps", "1"], "--bf16: 'yes': pass --bf16 alone (always bf16) or --bf16 auto"),
])
def test_out_of_range_numbers_are_usage_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_a_folder_that_holds_no_checkpoint_is_a_backbone_error(tmp_path, capsys):
    with pytest.raises(BackboneError) as error:
        load_backbone(tmp_path)
    assert isinstance(error.value, OSError)  # callers that catch loading failures still do
    _fails_cleanly(["accounting", "--backbone", str(tmp_path), "--context-len", "64"], capsys,
                   f"cannot load {str(tmp_path)!r}")


def test_missing_input_files_fail_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr("residualkv.backbones.load_backbone", no_model)
    monkeypatch.setattr("residualkv.cli.load_backbone", no_model)
    out, gone = str(tmp_path / "e.json"), str(tmp_path / "gone")
    _fails_cleanly(["train", "--data", gone, "--steps", "1"], capsys, f"--data {gone}: no such file or folder")
    _fails_cleanly(["train", "--init-from", gone, "--steps", "1"], capsys, f"--init-from {gone}: no such codec folder")
    _fails_cleanly(["eval", "--methods", "full,residualkv", "--codec", gone, "--json", out], capsys,
                   f"--codec {gone}: no such codec folder", "models:/NAME@ALIAS")
    _fails_cleanly(["generate", "hi", "--method", "residualkv", "--codec", gone], capsys,
                   "no such codec folder")
    # a registry URI the store does not serve: the registry says so, still before the model loads
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    from registry.store import client

    client().search_registered_models()  # the store's first use logs its table creation: not part of the error
    capsys.readouterr()
    _fails_cleanly(["eval", "--methods", "full,residualkv", "--codec", "models:/rkv-nothing@champion", "--json", out],
                   capsys, "models:/rkv-nothing@champion")


@pytest.mark.parametrize("flag", ["--tolerance", "--nll-tolerance", "--flips", "--speed-tolerance"])
def test_a_negative_bench_regress_tolerance_is_a_usage_error(flag, capsys):
    """It would flag every metric as a regression: exit 1, which a CI gate reads as a failed run."""
    from flows.cli import main as flows_main

    with pytest.raises(SystemExit) as exit_:
        flows_main(["bench-regress", flag, "-0.5"])
    assert exit_.value.code == 2 and "needs a finite number >= 0, got -0.5" in capsys.readouterr().err


def test_checks_that_used_to_exit_1_are_bad_input_too(tmp_path, capsys):
    """A CI gate reads exit 1 as a failed run and 2 as a wrong call: these are wrong calls."""
    out = str(tmp_path / "e.json")
    _fails_cleanly(["eval", "--methods", "full", "--context-len", "2048,x", "--json", out], capsys,
                   "--context-len takes integers")
    _fails_cleanly(["eval", "--methods", "full", "--full-from", str(tmp_path / "none_predictions.jsonl"),
                    "--json", out], capsys, "--full-from", "no such predictions file")
    _fails_cleanly(["pool", str(tmp_path / "none_predictions.jsonl"), "--json", out], capsys,
                   "no such predictions file")
    _fails_cleanly(["eval", "--methods", "full,residualkv", "--json", out], capsys,
                   "no trained codec for smollm2-135m", "rkv train --backbone smollm2-135m")
    _fails_cleanly(["train", "--init", "fisher-pca", "--init-from", str(tmp_path), "--steps", "1"], capsys,
                   "start the codec two ways")
