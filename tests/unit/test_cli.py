"""`miles train` and `miles sft` read overrides alone, without a TOML file."""

import pytest

from miles.cli import main


@pytest.mark.parametrize("command", ["train", "sft"])
def test_overrides_without_a_config_file_are_read_as_overrides(command, tmp_path):
    missing = tmp_path / "no-model"
    # Before the fix argparse took the second override's value for the TOML path and refused it.
    with pytest.raises(SystemExit, match=f"model.path: model directory '{missing}' does not exist"):
        main([command, "--model.path", str(missing), "--run.output_dir", str(tmp_path)])
