"""What the scripts that test `kestrel serve` on the real model share: their arguments (exit 77,
skipped, when the model is absent), `kestrel serve` started on a free port and stopped with
SIGTERM, checks printed one per line with a summary at the end, and JSON replies validated
against their schemas. Standard library only (`jsonschema` where it is installed)."""
import atexit
import json
import os
import re
import signal
import subprocess
import sys
import threading

try:
    import jsonschema
except ImportError:
    jsonschema = None

NAME = "smollm2"  # --served-model-name
failures = []


def arguments():
    """(KESTREL_BINARY, MODEL_PATH) from the command line; exits 77 when the model is absent."""
    if len(sys.argv) != 3:
        print(f"usage: {sys.argv[0]} KESTREL_BINARY MODEL_PATH")
        sys.exit(2)
    binary, model = sys.argv[1], sys.argv[2]
    if not os.path.exists(model):
        print(f"skipped: {model} is absent (scripts/fetch_model.sh)")
        sys.exit(77)
    return binary, model


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)
    return cond


def start_server(binary, model, *args):
    """`kestrel serve` on a free port with these extra arguments: (process, port). Its stderr is
    drained (echoed) so that the server never blocks on it."""
    p = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", "--served-model-name", NAME, *args],
                         stderr=subprocess.PIPE, text=True)
    atexit.register(_kill_if_running, p)  # a script that dies before stop_server leaves no server
    for line in p.stderr:
        m = re.search(r"on http://[\d.]+:(\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, int(m.group(1))
    p.wait(timeout=30)
    raise RuntimeError(f"the server did not start (exit status {p.returncode})")


def _kill_if_running(p):
    if p.poll() is None:
        p.kill()
        p.wait()


def stop_server(p, timeout=20):
    """SIGTERM, then the exit status (None when it had to be killed)."""
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None


def finish():
    """Prints the summary and exits 1 when a check failed."""
    print(f"{len(failures)} checks failed" if failures else "all checks passed")
    sys.exit(1 if failures else 0)


def parsed(text):
    """The JSON value of `text`, or None."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


def valid(instance, schema):
    """Whether `instance` fits `schema`: by `jsonschema` when it is installed, else by hand for the
    keywords the tests' schemas use (enum, object, array, string, integer, boolean)."""
    if jsonschema is not None:
        try:
            jsonschema.validate(instance, schema)
            return True
        except jsonschema.ValidationError as e:
            print(f"     {e.message}")
            return False

    def fits(v, s):
        if "enum" in s:
            return v in s["enum"]
        t = s.get("type")
        if t == "object":
            props = s.get("properties", {})
            return (isinstance(v, dict) and all(k in v for k in s.get("required", []))
                    and all(k in props and fits(x, props[k]) for k, x in v.items()))
        if t == "array":
            return (isinstance(v, list) and s.get("minItems", 0) <= len(v) <= s.get("maxItems", 1 << 30)
                    and all(fits(x, s["items"]) for x in v))
        if t == "string":
            return isinstance(v, str) and len(v) <= s.get("maxLength", 1 << 30)
        if t == "integer":
            return (isinstance(v, int) and not isinstance(v, bool)
                    and s.get("minimum", -1 << 62) <= v <= s.get("maximum", 1 << 62))
        if t == "boolean":
            return isinstance(v, bool)
        return True
    return fits(instance, schema)
