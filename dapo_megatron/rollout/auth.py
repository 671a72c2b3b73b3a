"""Who may call an engine: SGLang 0.5.21's API keys, shared by our client, our launchers and the CPU engine.

    keys = ensure_secret_file(run_secret_path(run_dir))   # once per run: 0600, reused by a requeue / --resume
    argv += ["--config", str(run_secret_path(run_dir))]   # SGLang and serve-rollout read api-key / admin-api-key
    client = EngineClient(url, keys=keys)                  # Bearer on every request, the key its endpoint needs
    decide("POST", "/update_weights_from_tensor", header, api_key=..., admin_api_key=...)  # None or 401 / 403

SGLang (srt/utils/auth.py `decide_request_auth`, entrypoints/http_server.py `@auth_level`, server_args
--api-key / --admin-api-key):
  - /health*, /ready*, /metrics* and OPTIONS are always open (probes carry no secret);
  - ADMIN_OPTIONAL endpoints (every weight, memory, cache, pause and abort endpoint) need the admin key
    when one is set, else the api key when one is set, else nothing;
  - every other endpoint (NORMAL: /generate, /model_info, /server_info, and any path no route matches,
    a known path with another method included) needs the api key when one is set, else nothing: with
    only an admin key, /generate is open;
  - the key travels as `Authorization: Bearer <key>` ("bearer" in any case), compared in constant time;
    a refusal is HTTP 401 {"error": "Unauthorized"} (403 {"error": "Forbidden"} is for ADMIN_FORCE
    endpoints without an admin key; none of the endpoints we call or serve is one).
The run's engines get one per-run secret as both keys (so every endpoint but the probes needs it). It
lives in <run_dir>/secrets/engine_auth.yaml, in the YAML of SGLang's `--config` (`api-key`, `admin-api-key`),
so the key never appears on a command line (where `ps` shows it to every user of the node).
Engines a user starts (rollout.engine_urls) get their keys from rollout.engine_api_key_env /
rollout.engine_api_key_file (and the admin_ pair): an environment variable's name or a file path, never
the key itself in the YAML. tests/conformance/test_engine_auth_sglang.py checks all of this against
SGLang's own middleware.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

OPEN = "open"
NORMAL = "normal"
ADMIN_OPTIONAL = "admin_optional"

# (method, path) -> SGLang's @auth_level of that route (http_server.py); a route that lists GET and POST
# in SGLang (api_route) is listed with both. Absent: NORMAL (SGLang's fallback when no route matches).
ENDPOINT_LEVELS: dict[tuple[str, str], str] = {
    ("POST", "/generate"): NORMAL,
    ("PUT", "/generate"): NORMAL,
    ("GET", "/model_info"): NORMAL,
    ("GET", "/get_model_info"): NORMAL,
    ("GET", "/server_info"): NORMAL,
    ("GET", "/get_server_info"): NORMAL,
    **{
        ("POST", p): ADMIN_OPTIONAL
        for p in (
            "/abort_request",
            "/pause_generation",
            "/continue_generation",
            "/begin_weight_update",
            "/end_weight_update",
            "/init_weights_update_group",
            "/destroy_weights_update_group",
            "/update_weights_from_distributed",
            "/update_weights_from_tensor",
            "/update_weights_from_disk",
            "/update_weight_version",
        )
    },
    **{
        (m, p): ADMIN_OPTIONAL
        for m in ("GET", "POST")
        for p in ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation", "/get_weights_by_name")
    },
}
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # decide_request_auth matches them by prefix
SECRET_FILE = "engine_auth.yaml"


def level_of(method: str, path: str) -> str:
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return OPEN
    # HEAD is served by every GET route (Starlette and aiohttp alike)
    return ENDPOINT_LEVELS.get(("GET" if method == "HEAD" else method, path), NORMAL)


def _bearer_matches(header: str | None, key: str) -> bool:
    if not header:
        return False
    parts = header.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return hmac.compare_digest(parts[1].encode(), key.encode())  # constant time, as secrets.compare_digest


def decide(
    method: str, path: str, authorization: str | None, *, api_key: str | None, admin_api_key: str | None
) -> int | None:
    """None when the request may pass, else the HTTP status SGLang answers (decide_request_auth)."""
    level = level_of(method, path)
    if level == OPEN:
        return None
    if level == ADMIN_OPTIONAL and admin_api_key:
        return None if _bearer_matches(authorization, admin_api_key) else 401
    if api_key:
        return None if _bearer_matches(authorization, api_key) else 401
    return None


def refusal_body(status: int) -> dict:
    """SGLang's middleware answer (ORJSONResponse)."""
    return {"error": "Unauthorized" if status == 401 else "Forbidden"}


@dataclass(frozen=True)
class EngineKeys:
    api_key: str | None = None
    admin_api_key: str | None = None

    def header_for(self, method: str, path: str) -> dict[str, str]:
        """The Authorization header a request needs: the admin key for ADMIN_OPTIONAL endpoints when one is
        set, else the api key (sent to open endpoints too: harmless, and the same on every request)."""
        key = self.admin_api_key if level_of(method, path) == ADMIN_OPTIONAL and self.admin_api_key else self.api_key
        key = key or self.admin_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def __repr__(self) -> str:  # never print a key (tracebacks, logs)
        return (
            f"EngineKeys(api_key={'set' if self.api_key else None}, "
            f"admin_api_key={'set' if self.admin_api_key else None})"
        )


# ---------------------------------------------------------------------------------------- the run's secret
def run_secret_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "secrets" / SECRET_FILE


def _check_private(path: Path, what: str) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"{what} '{path}' can be read by other users (mode {stat.S_IMODE(mode):o}); "
            f"it holds an engine key: chmod 600 '{path}'"
        )


def read_secret_file(path: str | Path) -> EngineKeys:
    """The keys of an SGLang --config file holding `api-key: "..."` / `admin-api-key: "..."` lines."""
    import yaml

    path = Path(path)
    _check_private(path, "engine key file")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"engine key file '{path}': expected api-key / admin-api-key entries")
    keys = EngineKeys(
        api_key=_opt_key(data.get("api-key"), path), admin_api_key=_opt_key(data.get("admin-api-key"), path)
    )
    if not (keys.api_key or keys.admin_api_key):
        raise ValueError(f"engine key file '{path}': neither api-key nor admin-api-key is set")
    return keys


def _opt_key(value, where) -> str | None:
    if value is None:
        return None
    check_key(str(value), where)
    if str(value).startswith("-"):  # SGLang's --config turns it into argv, where argparse reads it as an option
        raise ValueError(
            f"engine key file '{where}': a key may not start with '-' (SGLang's --config passes it "
            "through argparse); delete the file to have a new key made"
        )
    return str(value)


def check_key(key: str, where) -> None:
    """A key must fit in one HTTP header line after "Bearer " (no whitespace or control characters)."""
    if not key or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError(f"{where}: an engine key must be non-empty, without spaces or control characters")


def ensure_secret_file(path: str | Path) -> EngineKeys:
    """Create the run's secret once (32 random bytes in hex, both keys, mode 0600 in a 0700 folder) or read the one
    there: a requeued job or `--resume` reuses it, so engines still running keep accepting the trainer.
    Several processes may call this at once (engines and trainer of one Slurm run): the file appears
    whole (written aside, then hard-linked into place), and whoever loses the race reads the winner's."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # hex: a key starting with "-" (token_urlsafe does, 1 time in 64) reaches SGLang's argparse through
        # --config as `--api-key -x...` and is taken for an option ("expected one argument")
        key = secrets.token_hex(32)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")  # mkstemp: 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(
                    f"# this run's engine key (dapo_megatron/rollout/auth.py); SGLang --config format\n"
                    f'api-key: "{key}"\nadmin-api-key: "{key}"\n'
                )
            try:
                os.link(tmp, path)  # atomic, and fails if another process got there first
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    return read_secret_file(path)


# ---------------------------------------------------------------------------------------- user-started engines
def _key_from(env_name: str, file_path: str, env_key: str, file_key: str) -> str | None:
    if env_name:
        value = os.environ.get(env_name, "")
        if not value:
            raise ValueError(f"config key '{env_key}': the environment variable {env_name} is not set or empty")
        check_key(value, f"config key '{env_key}' (${env_name})")
        return value
    if file_path:
        path = Path(file_path).expanduser()
        if not path.is_file():
            raise ValueError(f"config key '{file_key}': no such file '{path}'")
        _check_private(path, f"config key '{file_key}': file")
        value = path.read_text().strip()
        check_key(value, f"config key '{file_key}' ('{path}')")
        return value
    return None


def keys_from_config(rollout) -> EngineKeys:
    """The keys of engines the user started (rollout.engine_urls): from rollout.engine_api_key_env or
    rollout.engine_api_key_file, and rollout.engine_admin_api_key_env / _file; none set: no keys."""
    return EngineKeys(
        api_key=_key_from(
            rollout.engine_api_key_env,
            rollout.engine_api_key_file,
            "rollout.engine_api_key_env",
            "rollout.engine_api_key_file",
        ),
        admin_api_key=_key_from(
            rollout.engine_admin_api_key_env,
            rollout.engine_admin_api_key_file,
            "rollout.engine_admin_api_key_env",
            "rollout.engine_admin_api_key_file",
        ),
    )


def engine_keys(rollout, run_dir: str | Path) -> EngineKeys:
    """What the trainer sends: the user's keys for rollout.engine_urls, else the run's secret (created if
    no launcher has yet: the engines of a Slurm run read the same file)."""
    if rollout.engine_urls:
        return keys_from_config(rollout)
    return ensure_secret_file(run_secret_path(run_dir))
