"""`specdial policy simulate` with draft trees (issue 29): tree bounds from SGLang's flags or the
config's "tree" key; the report has adaptive trees, the best fixed shape and adaptive chains."""

import json

import pytest

from specdial import AdaptiveConfig
from specdial._core import ConfigError
from specdial.cli import main
from specdial.policy_sim import run_tree_simulation, tree_policy

SMALL = ["--curve", "h200-llama8b", "--concurrency", "1", "--concurrency", "64",
         "--segments", "300"]


def _tree_config(tmp_path, tree):
    data = json.loads(AdaptiveConfig.default().to_json())
    data["tree"] = tree
    path = tmp_path / "trees.json"
    path.write_text(json.dumps(data))
    return path


def test_flags_give_the_tree_report_rows(capsys):
    argv = ["policy", "simulate", "--speculative-eagle-topk", "4",
            "--speculative-num-draft-tokens", "17", *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("h200-llama8b")]
    assert [r[1] for r in rows] == ["1", "64"]
    for r in rows:
        trees, fixed, chains, over_fixed, over_chains = map(float, r[2:7])
        assert over_fixed == pytest.approx(trees / fixed, abs=1e-3)
        assert over_chains == pytest.approx(trees / chains, abs=1e-3)
        # the best fixed plan is the best in hindsight of every plan the policy can choose,
        # chains included; trees only where the bounds allow (top-k <= 4, <= 16 nodes)
        name = r[r.index("/") - 1]
        assert name.startswith(("chain-", "tree-"))
        if name.startswith("tree-"):
            _, k, n = map(int, name[5:].split("x"))
            assert k <= 4 and n <= 16
    assert "trees / best fixed: mean" in out


def test_the_config_tree_key_and_json(capsys, tmp_path):
    path = _tree_config(tmp_path, {"max_topk": 2, "max_num_draft_tokens": 8})
    assert main(["policy", "simulate", "--config", f"t={path}", "--json", *SMALL]) == 0
    cases = json.loads(capsys.readouterr().out)
    assert [(c["curve"], c["concurrency"]) for c in cases] == [("h200-llama8b", 1),
                                                              ("h200-llama8b", 64)]
    for c in cases:
        assert c["trees"]["name"] == "goodput-trees" and c["chains"]["name"] == "goodput"
        assert c["best_fixed"]["goodput"] >= c["best_fixed_chain"]["goodput"]
        assert sum(n for _, n in c["trees"]["plans"]) == c["trees"]["iterations"]
        assert c["chains"]["tree_iterations"] == 0
        for name, _ in c["trees"]["plans"]:
            if name.startswith("tree-"):
                _, k, n = map(int, name[5:].split("x"))
                assert k <= 2 and n <= 8


def test_trees_pay_at_batch_one_on_an_accelerator():
    config = tree_policy(None, 8, 65)
    assert config is not None
    (case,) = run_tree_simulation(config, curves=["a100-llama8b"], concurrency=[1],
                                  segments=1500, seed=0)
    assert case["trees"]["goodput"] > 1.15 * case["chains"]["goodput"]
    assert case["best_fixed"]["name"].startswith("tree-")


def test_tree_policy_bounds():
    assert tree_policy(None, None, None) is None
    assert tree_policy(AdaptiveConfig.default(), None, None) is None
    c = tree_policy(None, 8, 65)
    assert json.loads(c.to_json())["tree"] == {"max_topk": 8, "max_num_draft_tokens": 64}
    # a config's own tree key is kept; flags equal to it agree
    assert tree_policy(c, None, None) == c
    assert tree_policy(c, 8, 65) == c
    with pytest.raises(ConfigError, match="differs"):
        tree_policy(c, 4, 17)
    with pytest.raises(ConfigError, match="give both"):
        tree_policy(None, 8, None)
    with pytest.raises(ConfigError, match="top-k >= 2"):
        tree_policy(None, 1, 8)
    with pytest.raises(ConfigError, match="goodput"):
        tree_policy(AdaptiveConfig.ema_default(), 4, 17)
    # named as the flags are, in SGLang's counting (test_first_hour.py)
    with pytest.raises(ConfigError, match=r"speculative_eagle_topk: must be in 2\.\.=16"):
        tree_policy(None, 40, 17)


@pytest.mark.parametrize("extra, message", [
    (["--regime", "steady-code"], "--regime does not apply"),
    (["--noise", "0.3"], "--noise does not apply"),
    (["--concurrency", "3"], "concurrency 3 is not one of"),
    (["--speculative-eagle-topk", "4"], "give both"),
])
def test_bad_tree_options_name_the_option(capsys, extra, message):
    argv = ["policy", "simulate", "--curve", "cpu-like", "--segments", "50", *extra]
    if "--speculative-eagle-topk" not in extra:
        argv += ["--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "9"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_concurrency_without_trees_is_refused(capsys):
    assert main(["policy", "simulate", "--curve", "cpu-like", "--concurrency", "4"]) == 2
    assert "--concurrency is for the tree simulation" in capsys.readouterr().err
