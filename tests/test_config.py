"""Tests of common/config.py: parsing, defaults, path resolution, round trips, and one-line
errors that name the file and the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from common import constants as C
from common.config import (
    ClusterConfig,
    ConfigError,
    DataConfig,
    MasterConfig,
    WorkerConfig,
    build_params,
    config_to_dict,
    load_config,
    parse_config,
)
from common.models.mlp_params import MLPParams
from master.strategies import make_strategy

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def config_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert str(path) in msg, msg
    return msg


def roundtrip(cfg: ClusterConfig) -> ClusterConfig:
    text = yaml.safe_dump(config_to_dict(cfg))
    return parse_config(yaml.safe_load(text), source=cfg.source)


# ---------------------------------------------------------------------------- good configs
def test_repository_cluster_yaml():
    path = ROOT / "cluster.yaml"
    if not path.exists():
        pytest.skip("no top-level cluster.yaml in this checkout")
    cfg = load_config(path)
    raw = yaml.safe_load(path.read_text()) or {}
    assert cfg.source == str(path)
    assert cfg.rounds >= 1 and cfg.family
    assert Path(cfg.data.path).is_absolute()
    assert Path(cfg.output_dir).is_absolute()
    rel = (raw.get("data") or {}).get("path", DataConfig().path)
    assert cfg.data.path == str((ROOT / rel).resolve())
    names = [w.name for w in cfg.workers]
    assert len(names) == len(set(names))
    if cfg.family == "mlp":
        build_params(MLPParams, cfg.family_params, f"{cfg.source}: model")
    make_strategy(cfg.strategy["name"], **cfg.strategy_params)
    assert roundtrip(cfg) == cfg


def test_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for raw in (None, {}):
        cfg = parse_config(raw)
        assert cfg.master == MasterConfig()
        assert cfg.master.host == "127.0.0.1" and cfg.master.bind == "*"
        assert cfg.master.pub_port == C.DEFAULT_PUB_PORT
        assert cfg.master.rep_port == C.DEFAULT_REP_PORT
        assert cfg.master.pub_endpoint == f"tcp://127.0.0.1:{C.DEFAULT_PUB_PORT}"
        assert cfg.master.rep_bind == f"tcp://*:{C.DEFAULT_REP_PORT}"
        assert cfg.workers == []
        assert cfg.model == {"family": "mlp"} and cfg.family == "mlp"
        assert cfg.family_params == {}
        assert cfg.strategy == {"name": "fedavg"} and cfg.strategy_params == {}
        assert cfg.rounds == 20 and cfg.min_workers == 1 and cfg.seed == 0
        assert cfg.round_deadline == C.ROUND_DEADLINE and cfg.join_timeout == C.JOIN_TIMEOUT
        assert cfg.baselines is True
        assert cfg.data.task == DataConfig().task and cfg.data.test_fraction == 0.2
        # Relative defaults resolve against the working directory when there is no file.
        assert cfg.data.path == str((tmp_path / DataConfig().path).resolve())
        assert cfg.output_dir == str((tmp_path / "runs/latest").resolve())


def test_minimal_config_file(tmp_path):
    path = write(tmp_path, "rounds: 3\nworkers: [a, {name: b, host: 10.0.0.2}]\n"
                           "strategy: mean\nmodel: {family: mlp, hidden: 32, lr: 0.01}\n")
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert cfg.rounds == 3
    assert cfg.workers == [WorkerConfig(name="a"), WorkerConfig(name="b", host="10.0.0.2")]
    assert cfg.worker("b").host == "10.0.0.2"
    assert cfg.strategy == {"name": "mean"}
    assert cfg.family == "mlp" and cfg.family_params == {"hidden": 32, "lr": 0.01}
    params = build_params(MLPParams, cfg.family_params, f"{cfg.source}: model")
    assert params == MLPParams(hidden=32, lr=0.01)
    with pytest.raises(ConfigError, match=r"no worker named 'c' \(known: a, b\)"):
        cfg.worker("c")


def test_full_config(tmp_path):
    path = write(tmp_path, """
master: {host: 192.168.1.5, bind: 0.0.0.0, pub_port: 7000, rep_port: 7001}
workers:
  - {name: w1, device: cpu, host: cpu-box}
  - {name: w2, device: cuda, host: gpu-box}
model: {family: mlp, hidden: 64, optimizer: sgd}
strategy: {name: fedavg}
rounds: 5
min_workers: 2
round_deadline: 30
join_timeout: 12.5
data: {task: multiclass, positive: null, partition: iid, alpha: 1.0, test_fraction: 0.25,
       limit: 500, proportions: [0.5, 0.5]}
output_dir: out
baselines: false
seed: 42
""")
    cfg = load_config(path)
    assert cfg.master.pub_endpoint == "tcp://192.168.1.5:7000"
    assert cfg.master.rep_bind == "tcp://0.0.0.0:7001"
    assert [w.device for w in cfg.workers] == ["cpu", "cuda"]
    assert (cfg.rounds, cfg.min_workers, cfg.seed, cfg.baselines) == (5, 2, 42, False)
    assert cfg.round_deadline == 30 and cfg.join_timeout == 12.5
    assert cfg.data.positive is None and cfg.data.limit == 500
    assert cfg.data.proportions == [0.5, 0.5]
    assert cfg.output_dir == str(tmp_path / "out")


def test_relative_paths_resolve_against_the_yaml_folder(tmp_path, monkeypatch):
    conf_dir = tmp_path / "conf"
    path = write(conf_dir, """
workers:
  - {name: w1, data: shards/w1.jsonl}
  - {name: w2, data: /abs/w2.jsonl}
  - {name: w3}
data: {path: ../data/set.jsonl, cache_dir: cache}
output_dir: runs/x
""")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    assert cfg.data.path == str((tmp_path / "data" / "set.jsonl").resolve())
    assert cfg.data.cache_dir == str((conf_dir / "cache").resolve())
    assert cfg.output_dir == str((conf_dir / "runs" / "x").resolve())
    assert cfg.workers[0].data == str((conf_dir / "shards" / "w1.jsonl").resolve())
    assert cfg.workers[1].data == "/abs/w2.jsonl"
    assert cfg.workers[2].data is None
    # The same file loaded through a relative path gives the same result.
    monkeypatch.chdir(tmp_path)
    assert load_config(Path("conf") / "cluster.yaml").data.path == cfg.data.path


def test_with_workers(tmp_path):
    cfg = load_config(write(tmp_path, "workers: [x]\nmin_workers: 5\n"))
    eight = cfg.with_workers(8)
    assert [w.name for w in eight.workers] == [f"w{i}" for i in range(1, 9)]
    assert all(w == WorkerConfig(name=w.name) for w in eight.workers)
    assert eight.min_workers == 5
    assert [w.name for w in cfg.workers] == ["x"]  # the original is untouched
    assert cfg.with_workers(2).min_workers == 2
    assert eight.source == cfg.source and eight.rounds == cfg.rounds
    for n in (0, -1):
        with pytest.raises(ConfigError, match="at least 1 worker"):
            cfg.with_workers(n)


def test_config_to_dict_roundtrip(tmp_path):
    path = write(tmp_path, """
master: {pub_port: 6100, rep_port: 6101}
workers: [a, {name: b, data: b.jsonl, device: cpu}]
model: {family: mlp, hidden: 16, lr: 0.5}
strategy: {name: mean}
rounds: 7
data: {partition: iid, alpha: 2.0, limit: 10, cache_dir: c, proportions: [0.25, 0.75]}
baselines: false
seed: 3
""")
    cfg = load_config(path)
    d = config_to_dict(cfg)
    assert "source" not in d
    assert d["workers"][0] == {"name": "a", "device": "auto"}  # no host: none was given
    assert d["data"]["embedding_model"] is None  # kept: a null can differ from the default
    assert roundtrip(cfg) == cfg
    assert roundtrip(cfg.with_workers(8)) == cfg.with_workers(8)
    # And through a file, as `fedctl run` saves it.
    saved = write(tmp_path / "saved", yaml.safe_dump(config_to_dict(cfg)))
    again = load_config(saved)
    again.source = cfg.source
    assert again == cfg


def test_config_to_dict_roundtrip_of_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = parse_config({})
    assert roundtrip(cfg) == cfg


def test_config_to_dict_roundtrip_keeps_positive_null(tmp_path):
    cfg = load_config(write(tmp_path, "data: {task: multiclass, positive: null}\n"))
    assert cfg.data.positive is None
    assert roundtrip(cfg).data.positive is None


# ---------------------------------------------------------------------------- bad configs
@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("bogus: 1\n", "bogus"),
        ("rounds: 2\nRounds: 3\n", "Rounds"),
        ("master: {colour: red}\n", "master.colour"),
        ("master: [a]\n", "master"),
        ("data: {pathh: x}\n", "data.pathh"),
        ("master: {pub_port: 70000}\n", "master.pub_port"),
        ("master: {pub_port: 0}\n", "master.pub_port"),
        ("master: {rep_port: -5}\n", "master.rep_port"),
        ("master: {rep_port: '5556'}\n", "master.rep_port"),
        ("master: {rep_port: 65536}\n", "master.rep_port"),
        ("master: {pub_port: 6000, rep_port: 6000}\n", "master.rep_port"),
        ("master: {host: ''}\n", "master.host"),
        ("workers: [a, b, a]\n", "workers[2].name"),
        ("workers: [{name: a}, {name: a, host: h}]\n", "workers[1].name"),
        ("workers: [{host: h}]\n", "workers[0].name"),
        ("workers: [a, {name: ''}]\n", "workers[1].name"),
        ("workers: [{name: a, gpu: 1}]\n", "workers[0].gpu"),
        ("workers: [7]\n", "workers[0]"),
        ("workers: w1\n", "workers"),
        ("rounds: 0\n", "rounds"),
        ("rounds: 100000000\n", "rounds"),
        ("rounds: ten\n", "rounds"),
        ("rounds: 2.5\n", "rounds"),
        ("checkpoint_budget: 0\n", "checkpoint_budget"),
        ("checkpoint_budget: 1.5\n", "checkpoint_budget"),
        ("memory_limit_mb: 0\n", "memory_limit_mb"),
        ("memory_limit_mb: lots\n", "memory_limit_mb"),
        ("rounds: true\n", "rounds"),
        ("min_workers: 0\n", "min_workers"),
        ("round_deadline: 0\n", "round_deadline"),
        ("join_timeout: soon\n", "join_timeout"),
        ("seed: 1.5\n", "seed"),
        ("baselines: 1\n", "baselines"),
        ("output_dir: ''\n", "output_dir"),
        ("data: {test_fraction: 1.5}\n", "data.test_fraction"),
        ("data: {test_fraction: 0}\n", "data.test_fraction"),
        ("data: {alpha: -1}\n", "data.alpha"),
        ("data: {limit: 0}\n", "data.limit"),
        ("data: {path: ''}\n", "data.path"),
        ("model: {hidden: 3}\n", "model.family"),
        ("model: 5\n", "model.family"),
        ("workers: ['..']\n", "workers[0].name"),
        ("workers: [w1, ../../evil]\n", "workers[1].name"),
        ("workers: [.hidden]\n", "workers[0].name"),
        ("workers: ['a\\\\b']\n", "workers[0].name"),
        ("privacy: {target_epsilon: 1}\n", "privacy.target_epsilon"),
        ("strategy: 5\n", "strategy"),
        ("strategy: {lr: 1}\n", "strategy"),
    ],
)
def test_bad_config_names_file_and_field(tmp_path, text, field):
    msg = config_error(write(tmp_path, text))
    assert f": {field}" in msg, msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    msg = config_error(write(tmp_path, text))
    assert "mapping at the top level" in msg


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("rounds: 3\nseed: 0\n  bad: indent\n", 3),
        ("rounds: 3\nmaster: {host: [a\n", 3),
        ("rounds: 3\n\tseed: 1\n", 2),
        ("a: 'unclosed\n", 2),
        ("rounds: 3\nname: a\x07b\n", 2),  # a control character: PyYAML's ReaderError
    ],
)
def test_not_yaml_names_the_line(tmp_path, text, line):
    msg = config_error(write(tmp_path, text))
    assert "not valid YAML" in msg
    hint = ("; YAML indents with spaces, not tabs" if "\t" in text
            else ": a control character ('\\x07') where text was expected" if "\x07" in text
            else "")
    assert f"at line {line}{hint}" == msg.rsplit(": not valid YAML ", 1)[1], msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope" / "cluster.yaml"
    msg = config_error(path)
    assert msg == (f"{path}: no such file (`fedctl init --family NAME` writes a starter "
                   f"config; examples/ holds one for each family)")


def test_directory_instead_of_file(tmp_path):
    msg = config_error(tmp_path)
    assert "cannot read" in msg


def test_binary_file_is_a_config_error(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"\xff\xfe\x00rounds: 3\n")
    config_error(path)


@pytest.mark.parametrize("text", ["1: a\nfoo: b\n", "master: {1: a, foo: b}\n",
                                  "workers: [{name: a, 1: x, foo: y}]\n"])
def test_unknown_keys_of_mixed_types(tmp_path, text):
    config_error(write(tmp_path, text))


@pytest.mark.parametrize("text", ["workers: [{name: a, data: 5}]\n", "data: {cache_dir: 5}\n"])
def test_non_string_paths(tmp_path, text):
    config_error(write(tmp_path, text))


def test_unknown_key_with_newline_is_one_line(tmp_path):
    config_error(write(tmp_path, '"bad\\nkey": 1\n'))


# ---------------------------------------------------------------------------- build_params
def model_error(tmp_path: Path, model: str) -> str:
    cfg = load_config(write(tmp_path, f"model: {model}\n"))
    with pytest.raises(ConfigError) as info:
        build_params(MLPParams, cfg.family_params, f"{cfg.source}: model")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 'cluster.yaml'}: model.")
    return msg


def test_build_params_defaults_and_values():
    assert build_params(MLPParams, {}, "x: model") == MLPParams()
    p = build_params(MLPParams, {"hidden": 8, "local_epochs": 2, "batch_size": 4,
                                 "optimizer": "adamw", "lr": 1, "weight_decay": 0},
                     "x: model")
    assert (p.hidden, p.local_epochs, p.batch_size, p.optimizer) == (8, 2, 4, "adamw")
    assert p.lr == 1 and p.weight_decay == 0  # ints accepted where floats are expected


def test_build_params_unknown_field(tmp_path):
    msg = model_error(tmp_path, "{family: mlp, depth: 3}")
    assert ": model.depth: unknown field" in msg
    for name in ("hidden", "local_epochs", "batch_size", "optimizer", "lr", "weight_decay"):
        assert name in msg


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ("{family: mlp, hidden: big}", "model.hidden"),
        ("{family: mlp, hidden: 2.5}", "model.hidden"),
        ("{family: mlp, hidden: true}", "model.hidden"),
        ("{family: mlp, batch_size: '64'}", "model.batch_size"),
        ("{family: mlp, lr: fast}", "model.lr"),
        ("{family: mlp, lr: false}", "model.lr"),
        ("{family: mlp, optimizer: 3}", "model.optimizer"),
    ],
)
def test_build_params_wrong_type(tmp_path, model, field):
    msg = model_error(tmp_path, model)
    assert f": {field}: expected " in msg


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ("{family: mlp, optimizer: rmsprop}", "model.optimizer"),
        ("{family: mlp, hidden: 0}", "model.hidden"),
        ("{family: mlp, lr: -0.1}", "model.lr"),
    ],
)
def test_build_params_refused_by_the_dataclass(tmp_path, model, field):
    msg = model_error(tmp_path, model)
    assert f": {field}: expected " in msg
    if "rmsprop" in model:
        assert "'rmsprop'" in msg and "adam" in msg


def test_spread_cluster_needs_no_worker_host() -> None:
    """A worker reaches the master at master.host wherever it runs: setting master.host made
    every worker's host required, an error naming a field the user never touched."""
    cfg = parse_config({"master": {"host": "10.0.0.5"},
                        "workers": [{"name": "a", "host": "10.0.0.6"}, "b"]}, "cluster.yaml")
    assert [(w.name, w.host) for w in cfg.workers] == [("a", "10.0.0.6"), ("b", None)]
    assert cfg.master.rep_endpoint == "tcp://10.0.0.5:5556"


def test_model_may_be_just_its_family(tmp_path):
    """`model: nmf`, as `strategy: fedyogi`: the family with its defaults."""
    cfg = load_config(write(tmp_path, "model: nmf\n"))
    assert cfg.model == {"family": "nmf"}


def test_model_shorthand_takes_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "model: nmf\n"), ("model.n_topics=7",))
    assert cfg.model == {"family": "nmf", "n_topics": 7}


def test_a_numeric_positive_class_names_the_label_read_as_text() -> None:
    """Labels are read as text (a JSON 8 is "8"): `--set data.positive=8` named it, and was
    refused as "expected a string, got 8"."""
    cfg = parse_config({"data": {"path": "x.jsonl", "task": "one_vs_rest", "positive": 8}})
    assert cfg.data.positive == "8"
    from common.data.reading import make_task

    y, classes = make_task(["8", "3", "8"], task="one_vs_rest", positive=cfg.data.positive)
    assert y.tolist() == [1, 0, 1] and classes == ["rest", "8"]


def test_exponents_read_as_numbers_and_non_finite_ones_refused(tmp_path: Path) -> None:
    """PyYAML reads `1e-3` (no dot) as a string: `lr: 1e-3` was refused as "expected float,
    got '1e-3'", and the README writes `delta: 1e-5`. The loader reads YAML 1.2 floats; `.inf`
    and `.nan`, which no setting can take, are refused (`check` passed them and the run
    diverged)."""
    path = write(tmp_path, "workers: [w1, w2]\nmodel: {family: mlp, lr: 1e-3, hidden: 64}\n"
                           "privacy: {delta: 1E-5}\nround_deadline: 2e+1\n")
    cfg = load_config(path)
    assert cfg.family_params["lr"] == 1e-3 and cfg.privacy.delta == 1e-5
    assert cfg.round_deadline == 20.0
    assert yaml.safe_load("a: 1e-3") == {"a": "1e-3"}  # PyYAML's own loader is left as it is
    for bad in (".inf", ".nan"):  # (a family's fields are read where the family is built)
        params = load_config(write(tmp_path, f"model: {{family: mlp, lr: {bad}}}\n")).family_params
        with pytest.raises(ConfigError, match="model.lr: expected a finite float"):
            build_params(MLPParams, params, "model")
    msg = config_error(write(tmp_path, "round_deadline: .inf\n"))
    assert "round_deadline" in msg, msg
    from common.config import apply_overrides

    assert apply_overrides({}, ["model.lr=1e-2"], "<test>") == {"model": {"lr": 0.01}}


def test_a_secure_threshold_above_the_cluster_is_refused(tmp_path: Path) -> None:
    """A threshold past the workers could never reveal a round's sum: `check` passed it and
    the run showed a KeyError; `--workers N` below it is refused too."""
    from fedctl.cli import _load

    sa = "privacy: {secure_aggregation: {threshold: 3}}\n"
    two = write(tmp_path, "workers: [w1, w2]\n" + sa)
    with pytest.raises(ConfigError, match="threshold: 3 is more than the cluster's 2 workers"):
        _load(str(two))
    assert len(_load(str(two), workers=4).workers) == 4  # --workers 4 makes it enough
    cfg = load_config(write(tmp_path, "workers: [w1, w2, w3]\n" + sa))
    with pytest.raises(ConfigError, match="threshold: 3 is more than the cluster's 2 workers"):
        cfg.with_workers(2)


@pytest.mark.parametrize("family, change, message", [
    ("prodlda", {"strategy": "krum"},
     "strategy: krum would not be used in mode sync: the master takes one Adam step"),
    ("combinedtm", {"strategy": "fedprox"}, "strategy: fedprox would not be used in mode sync"),
    ("prodlda", {"compression": "int8"},
     "compression: int8 would not be used by prodlda (its workers send gradients"),
    ("lda", {"compression": "float16"},
     "compression: float16 would not be used by lda (its uploads are topics"),
])
def test_settings_a_family_would_ignore_are_refused(family: str, change: dict,
                                                    message: str) -> None:
    """Sync-mode NTMs ignored `strategy` (krum, fedmedian...), and lda and the NTMs ignored
    `compression`, without a word from `check`: a user believed they had a robust or smaller
    job."""
    from master.families import make_server_family

    cfg = parse_config({"workers": ["w1", "w2"], "rounds": 10, "model": {"family": family},
                        **change}, "cluster.yaml")
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_server_family(cfg)
    make_server_family(parse_config({"workers": ["w1", "w2"], "rounds": 10,
                                     "model": {"family": family}}, "cluster.yaml"))


def test_a_home_folder_in_paths_is_the_users_home(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`output_dir: ~/runs` made a folder literally named `~` beside the config."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config(write(tmp_path / "conf", "output_dir: ~/runs/x\n"
                                               "data: {path: ~/data.jsonl, cache_dir: ~/cache}\n"))
    assert cfg.output_dir == str(tmp_path / "home" / "runs" / "x")
    assert cfg.data.path == str(tmp_path / "home" / "data.jsonl")
    assert cfg.data.cache_dir == str(tmp_path / "home" / "cache")
