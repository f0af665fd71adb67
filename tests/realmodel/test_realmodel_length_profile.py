"""The accuracy gate's length profile on a real model's answers: `kvpolicy gate accuracy --length-buckets 3` against
real vLLM serving SmolLM2-135M-Instruct (the baseline judged against itself) passes, with a result per bucket."""

from __future__ import annotations

import pytest
from realmodel_helpers import RealModelServers, run_accuracy_gate

# A/A takes tens of prompts at each of three lengths (minutes on 2 CPU cores): `make test-realmodel`.
pytestmark = [pytest.mark.realvllm, pytest.mark.realmodel, pytest.mark.longgate]

LENGTH = 4096
BUCKETS = [1024, 2048, 4096]


def test_a_length_profile_on_the_real_model_passes_with_every_bucket_reported(
    real_model_servers: RealModelServers,
) -> None:
    baseline = real_model_servers.baseline.url
    run = run_accuracy_gate("A/A with a 3-bucket length profile", baseline, baseline, LENGTH, "--length-buckets", "3")
    report, context = run.report, f"{run.report}\n{run.log[-3000:]}"
    assert (report["verdict"], report["lengthTokens"]) == ("Pass", LENGTH), context
    profile = report["profile"]
    assert [bucket["lengthTokens"] for bucket in profile["buckets"]] == BUCKETS, context
    for bucket in profile["buckets"]:
        assert bucket["prompts"] == report["samples"] and bucket["needles"] > 0, context
        assert bucket["baselineScore"] > 0, context
    assert profile["systematicShift"] is False, context
    assert profile["baselineAuc"] > 0 and profile["aucRecovery"] is not None, context
