"""The seams of ``serve_app.models.compat`` that need Ray or a process of their own:
Serve's user-code thread flag, the KV store across processes, the head node resource,
a handle call's assignment to a replica.

An upgrade of Ray that moves or changes one of these internals fails its test here, by
name, before it fails a request (the in-process seams: tests/unit/test_compat.py).
"""

from __future__ import annotations

import pytest

from serve_app.models import compat


def python_lines(code: str, timeout: float) -> list[str]:
    """What ``code`` prints, run by this Python in a process of its own (a Ray of its own)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True, timeout=timeout).stdout.strip().splitlines()


@pytest.mark.parametrize("env, separate", [({}, True), (compat.serve_replica_env(), False)])
def test_serve_replica_env_switches_rays_user_code_thread(env, separate):
    """Ray Serve reads the flag at import; our value turns the second loop off."""
    import os
    import subprocess
    import sys

    code = ("from ray.serve._private import constants as c; "
            "print(c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == str(separate)


def test_kv_store_round_trips_across_processes_of_one_cluster():
    """What a replica writes in Ray's KV store, another process of the cluster reads."""
    code = (
        "import ray, subprocess, sys\n"
        "from serve_app.models import compat\n"
        "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "@ray.remote(num_cpus=0)\n"
        "def write():\n"
        "    compat.kv_put('ns_probe', 'app/m/r1', b'one')\n"
        "    compat.kv_put('ns_probe', 'app/m/r2', b'two')\n"
        "    compat.kv_put('ns_probe', 'app/other/r1', b'x')\n"
        "ray.get(write.remote())\n"
        "print(sorted(compat.kv_items('ns_probe', 'app/m/').items()))\n"
        "compat.kv_delete('ns_probe', 'app/m/r1')\n"
        "print(sorted(compat.kv_items('ns_probe', 'app/m/')))\n"
        "ray.shutdown()\n"
        "print(compat.kv_items('ns_probe', 'app/'))\n")
    out = python_lines(code, timeout=120)
    assert out == ["[('app/m/r1', b'one'), ('app/m/r2', b'two')]", "['app/m/r2']", "{}"]


def test_the_head_node_resource_marks_the_head_and_places_an_actor_there():
    """``HEAD_NODE_RESOURCE``: the head has it in ``ray.nodes()``, and an actor asking for
    a sliver of it runs on the head (the ingress's placement, ``ingress.on_head_node``)."""
    code = (
        "import ray\n"
        "from ray.cluster_utils import Cluster\n"
        "from serve_app.models.compat import HEAD_NODE_RESOURCE\n"
        "c = Cluster(initialize_head=True, head_node_args={'num_cpus': 1, "
        "'include_dashboard': False})\n"
        "worker = c.add_node(num_cpus=4)\n"
        "ray.init(address=c.address, log_to_driver=False)\n"
        "c.wait_for_nodes()\n"
        "heads = [n['NodeID'] for n in ray.nodes() if HEAD_NODE_RESOURCE in n['Resources']]\n"
        "@ray.remote(num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001})\n"
        "def where():\n"
        "    return ray.get_runtime_context().get_node_id()\n"
        "print(len(heads), ray.get(where.remote()) == heads[0] != worker.node_id)\n"
        "ray.shutdown(); c.shutdown()\n")
    out = python_lines(code, timeout=180)
    assert out[-1] == "1 True"


def test_assigned_to_replica_returns_once_a_replica_took_the_call():
    """``assigned_to_replica``: a handle call (whole or streamed) is assigned to a replica
    before its answer (the replica answers only once a gate opens, after the assignment
    was seen: were it waiting for the answer, it would wait for ever); a call no replica
    can take yet is not."""
    code = (
        "import asyncio, ray\n"
        "from ray import serve\n"
        "from serve_app.models.compat import assigned_to_replica\n"
        "ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)\n"
        "@ray.remote(num_cpus=0)\n"
        "class Gate:\n"
        "    def __init__(self):\n"
        "        self.opened = asyncio.Event()\n"
        "    async def wait(self):\n"
        "        await self.opened.wait()\n"
        "    async def open(self):\n"
        "        self.opened.set()\n"
        "@serve.deployment(max_ongoing_requests=1)\n"
        "class Gated:\n"
        "    def __init__(self, gate, stream_gate):\n"
        "        self.gate, self.stream_gate = gate, stream_gate\n"
        "    async def __call__(self):\n"
        "        await self.gate.wait.remote()\n"
        "        return 'done'\n"
        "    async def gen(self):\n"
        "        await self.stream_gate.wait.remote()\n"
        "        yield 'x'\n"
        "gate, stream_gate = Gate.remote(), Gate.remote()\n"
        "handle = serve.run(Gated.bind(gate, stream_gate), name='probe', route_prefix=None)\n"
        "async def assigned(call, seconds):\n"
        "    try:\n"
        "        await asyncio.wait_for(asyncio.shield(assigned_to_replica(call)), seconds)\n"
        "        return True\n"
        "    except TimeoutError:\n"
        "        return False\n"
        "async def main():\n"
        "    first = handle.remote()\n"
        "    before_its_answer = await assigned(first, 60)  # the gate is shut\n"
        "    second = handle.remote()  # the one replica is busy: not taken yet\n"
        "    waited = not await assigned(second, 1.0)\n"
        "    await gate.open.remote()\n"
        "    print(before_its_answer, await first == 'done', waited, await second == 'done')\n"
        "    stream = handle.options(stream=True).gen.remote()\n"
        "    print(await assigned(stream, 60))  # its gate is shut\n"
        "    await stream_gate.open.remote()\n"
        "    print([x async for x in stream])\n"
        "asyncio.run(main())\n"
        "serve.shutdown(); ray.shutdown()\n")
    out = python_lines(code, timeout=180)
    ours = [line for line in out if line.startswith(("True", "False", "["))]
    assert ours == ["True True True True", "True", "['x']"]
