"""Speculative decoding's refusals, each naming its key: a draft model whose tokenizer is
not the target's (``python -m serve_app check`` and the load), and the MTP method on a
checkpoint without an MTP head (``check`` and the load). Speculation's exactness on the
engine: tests/engine/test_speculative.py."""

from __future__ import annotations

import mlx_lm
import pytest

from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize


@pytest.mark.slow  # loads the real embedded model, SmolLM2-135M, as the draft
def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path, model_home):
    """``speculative.draft_model`` named in the error: SmolLM2 cannot draft for the tiny
    models (a byte-level tokenizer of their own)."""
    from serve_app.serving.service import load_draft_model

    _, tokenizer = mlx_lm.load(str(materialize("tiny-dense", tmp_path)))
    source = str(materialize("smollm2-135m", model_home))
    with pytest.raises(ValueError, match="speculative.draft_model: .* another tokenizer"):
        load_draft_model(source, tokenizer)


def test_check_refuses_a_draft_model_with_another_tokenizer(tmp_path, model_home):
    """``serve-app check`` reads both tokenizers (local files) and names the key; a draft
    with the same tokenizer passes."""
    import os
    import subprocess
    import sys

    import yaml

    def check(draft: str) -> subprocess.CompletedProcess:
        path = tmp_path / f"{draft.replace(':', '-')}.yaml"
        path.write_text(yaml.safe_dump({"applications": [{
            "name": "llm", "import_path": "serve_app.app:build_app",
            "args": {"models": [{"name": "m", "source": "embedded:tiny-dense",
                                 "speculative": {"method": "draft",
                                                 "draft_model": draft}}]}}]}))
        env = {**os.environ, "SERVE_APP_HOME": str(model_home), "HF_HUB_OFFLINE": "1"}
        return subprocess.run([sys.executable, "-m", "serve_app", "check", str(path)],
                              capture_output=True, text=True, env=env, timeout=600)

    bad = check("embedded:smollm2-135m")
    assert bad.returncode == 2, bad.stderr
    assert ("applications[0].args.models[0].speculative.draft_model: 'embedded:smollm2-135m' "
            "has another tokenizer") in bad.stderr
    good = check("embedded:tiny-dense-q4")
    assert good.returncode == 0, good.stderr


def test_mtp_without_an_mtp_head_is_refused_by_check_and_at_load(tmp_path, model_home):
    """``serve-app check`` names ``speculative.method`` for a checkpoint with no MTP head
    (the model beside it, which has one, passes); loading it anyway fails the same way."""
    import os
    import subprocess
    import sys

    import yaml

    from serve_app.serving.service import ModelService

    path = tmp_path / "mtp.yaml"
    models = [{"name": n, "source": f"embedded:{n}",
               "speculative": {"method": "mtp"}} for n in ("tiny-hybrid", "tiny-hybrid-mtp")]
    path.write_text(yaml.safe_dump({"applications": [{
        "name": "llm", "import_path": "serve_app.app:build_app", "args": {"models": models}}]}))
    env = {**os.environ, "SERVE_APP_HOME": str(model_home), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "serve_app", "check", str(path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2, done.stderr
    assert "applications[0].args.models[0].speculative.method: the checkpoint" in done.stderr
    assert "no mtp.* weights" in done.stderr and "models[1]" not in done.stderr
    hybrid = materialize("tiny-hybrid", model_home)
    model, tokenizer = mlx_lm.load(str(hybrid))
    with pytest.raises(ValueError, match=r"speculative.method: mtp: .*no mtp\.\* weights"):
        ModelService(ModelProfile(**models[0]), model, tokenizer, hybrid)
