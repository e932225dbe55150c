"""The vLLM engines and server several files share (vllm_shared.py), as fixtures: `edit_llama` (an
in-process llama for edits and steering), `default_layout_llama` (a llama in vLLM's default layout
for captures) and `llama_server` (`vllm serve` with named edits and a store). Each is started when a
test first asks for it and stays up while the files that follow use it; before the first test of a
file that does not, it is stopped (one engine up at a time). Nothing here imports vLLM until a
fixture is asked for: main's environment collects these files and skips them (gate.need).

A file uses one by naming the fixture; run the files that share one next to each other
(scripts/test-all's env_vllm lists them in that order) or it is started once per run of them.
"""

from __future__ import annotations

import pytest

ENGINES = {"edit_llama", "default_layout_llama"}  # the shared engines (llama_server is a server)


@pytest.fixture(scope="session")
def shared_vllm():
    from vllm_shared import OneAtATime

    shared = OneAtATime()
    yield shared
    shared.release()


@pytest.fixture(scope="module")
def edit_llama(shared_vllm, tmp_path_factory):
    """(directory, llm): vllm_shared.start_edit_llama's engine."""
    from vllm_shared import start_edit_llama

    return shared_vllm.get("edit_llama", lambda: start_edit_llama(tmp_path_factory.mktemp("edit_llama")))


@pytest.fixture(scope="module")
def default_layout_llama(shared_vllm, tmp_path_factory):
    """(directory, llm): vllm_shared.start_default_layout_llama's engine."""
    from vllm_shared import start_default_layout_llama

    return shared_vllm.get(
        "default_layout_llama",
        lambda: start_default_layout_llama(tmp_path_factory.mktemp("default_layout_llama")),
    )


@pytest.fixture(scope="module")
def llama_server(shared_vllm, tmp_path_factory):
    """(url, model, directory, out, log, proc): vllm_shared.start_llama_server's server. A test that needs
    it stopped (a store read after) calls `shared_vllm.release("llama_server")`."""
    from vllm_shared import start_llama_server

    return shared_vllm.get(
        "llama_server", lambda: start_llama_server(tmp_path_factory.mktemp("llama_server"))
    )


@pytest.fixture(autouse=True)
def the_shared_engine_as_new(request):
    """A test on the shared engine finds it as a new one: no hook on the worker's modules (a
    capture's, an edit block's, a registered named edit's) left by a test before it. A file that
    leaves one on purpose (test_vllm_steer.py registers a vector) releases the engine after it."""
    for name in ENGINES & set(request.fixturenames):
        from vllm_shared import hooks_left

        left = hooks_left(request.getfixturevalue(name).llm)
        assert left == [0], (
            f"the shared engine has {left} hooks before {request.node.nodeid}: a test before it left them"
        )
    yield


def _uses(module, name: str, items) -> bool:
    return any(name in getattr(i, "fixturenames", ()) for i in items if i.module is module)


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """The shared engine or server up is stopped once no test of the next file uses it."""
    shared = (getattr(item, "funcargs", None) or {}).get("shared_vllm")
    if shared is None or shared.name is None:
        return
    if nextitem is None or not _uses(nextitem.module, shared.name, item.session.items):
        shared.release()
