"""scripts/pip-settings-for-uv: pip's install settings (files and PIP_* variables) handed to uv.

uv reads none of pip's configuration; a machine whose torch comes from a local folder of wheels and
whose packages come partly from mirrors (this one) would get another torch, or none, without them.
The settings are written here, in a config file and the environment, and read back from the
script's output as uv options."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pip-settings-for-uv"


def uv_options(tmp_path: Path, config: str, **env: str) -> tuple[list[str], str]:
    (tmp_path / "pip.conf").write_text(config)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    environment.update(PIP_CONFIG_FILE=str(tmp_path / "pip.conf"), **env)
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=environment, capture_output=True, text=True, check=True
    )
    return done.stdout.split(), done.stderr


def pairs(options: list[str], flag: str) -> list[str]:
    return [options[i + 1] for i, option in enumerate(options) if option == flag]


def test_each_setting_becomes_the_uv_option_of_the_same_meaning(tmp_path):
    options, _ = uv_options(
        tmp_path,
        "[global]\nindex-url = https://mirror.example/simple\n"
        "extra-index-url = file:///srv/one/simple file:///srv/two/simple\n"
        "constraint = /srv/caps.txt\ncert = /srv/ca.pem\n[install]\ntrusted-host = mirror.example\n",
    )
    assert pairs(options, "--index-url") == ["https://mirror.example/simple"]
    assert pairs(options, "--extra-index-url")[-2:] == ["file:///srv/one/simple", "file:///srv/two/simple"]
    assert "/srv/caps.txt" in pairs(options, "--constraints")
    assert pairs(options, "--cert")[-1] == "/srv/ca.pem"
    assert pairs(options, "--allow-insecure-host") == ["mirror.example"]
    # pip takes the best version across all indexes; uv's default takes the first index that has one
    assert pairs(options, "--index-strategy") == ["unsafe-best-match"]


def test_the_environment_wins_over_the_files_as_in_pip(tmp_path):
    options, _ = uv_options(
        tmp_path, "[global]\nfind-links = /srv/from-file\n", PIP_FIND_LINKS="/srv/a /srv/b"
    )
    assert pairs(options, "--find-links") == ["/srv/a", "/srv/b"]


def test_a_setting_uv_lacks_is_named_not_passed(tmp_path):
    options, stderr = uv_options(tmp_path, "[global]\nprefer-binary = true\nno-index = true\n")
    assert "--no-index" in options
    assert "prefer-binary" in stderr and "prefer-binary" not in " ".join(options)
