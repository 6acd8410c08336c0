"""Known library warnings go to the run's log once; every other warning reaches the console."""

import warnings

from dapo_mega.driver.known_warnings import known_warning_lines, route_known_warnings


def test_known_warnings_logged_once_others_shown(tmp_path, monkeypatch):
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message)))
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    path = route_known_warnings(tmp_path, rank=0)
    assert path == tmp_path / "logs" / "warnings.log"
    for _ in range(3):
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning)
    warnings.warn("something the user must see", UserWarning)
    assert shown == ["something the user must see"]
    lines = known_warning_lines(path)
    assert len(lines) == 2 and "Apex is not installed" in lines[0] and lines[1].startswith("FutureWarning")
    # a second call (another run in the same process) moves the log, not the console
    assert route_known_warnings(tmp_path / "b", rank=1).name == "warnings-rank1.log"
    warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
    assert shown == ["something the user must see"]
