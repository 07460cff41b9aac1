"""pytest plugin loaded by .ci/interop.sh (`-p interop_plugin`, PYTHONPATH=.ci).

- registers the suites' `env` marker (py-amqp and kombu use @pytest.mark.env(...)
  without registering it);
- writes the final outcome of every test, by node id, as JSON to the file named by
  $INTEROP_RESULTS, for .ci/interop_report.py. Reruns (pytest-rerunfailures) are
  counted; a test's outcome is that of its last attempt.
"""
import json
import os

_results = {}
_reruns = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "env(name): broker environment the test needs")


def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    if report.outcome == "rerun":
        _reruns[nodeid] = _reruns.get(nodeid, 0) + 1
        _results.pop(nodeid, None)
        return
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            message = (crash.message.strip().splitlines() or [""])[0][:300]
            message += f" ({os.path.basename(crash.path)}:{crash.lineno})"
        else:
            message = (str(report.longrepr).strip().splitlines() or [""])[0][:300]
    if report.when == "setup":
        if report.failed:
            _results[nodeid] = ("error", "setup: " + message)
        elif report.skipped:
            _results[nodeid] = ("skipped", "")
    elif report.when == "call":
        if report.failed:
            _results[nodeid] = ("failed", message)
        elif report.skipped:
            _results[nodeid] = ("skipped", "")
        else:
            _results[nodeid] = ("passed", "")
    elif report.when == "teardown" and report.failed:
        _results[nodeid] = ("error", "teardown: " + message)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("INTEROP_RESULTS")
    if not path:
        return
    out = {
        "exitstatus": int(exitstatus),
        "tests": [
            {"id": k, "outcome": v[0], "message": v[1], "reruns": _reruns.get(k, 0)}
            for k, v in _results.items()
        ],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
