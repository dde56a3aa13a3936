"""The main-loop comparison of `python -m ringfa4.kernels --sass --compare` (ringfa4.kernels.sass),
on nvdisasm-style text: no GPU, no CUDA toolkit."""
import pytest

from ringfa4.kernels import __main__ as cli
from ringfa4.kernels import sass

HEADER = "\t.text.kernel:\n"


def _text(lines):
    return HEADER + "".join(f"        /*{16 * i:04x}*/                   {line} ;\n" for i, line in enumerate(lines))


LOOP = ["S2R R0, SR_TID.X", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT", "MUFU.EX2 R3, R3",
        "FFMA R4, R5, R6, -R7", "LDS.64 R8, [R9+0x20]", "HGMMA.64x64x16.F32.BF16 R152, R56, gdesc[UR16].tnspB, R152",
        "BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", "EXIT"]


def test_main_loop_spans_the_first_to_the_last_wgmma_with_names_normalized():
    loop = sass.main_loop(_text(LOOP))
    assert len(loop) == 5
    assert loop[0].startswith("HGMMA") and loop[-1].startswith("HGMMA")
    assert loop[3] == "LDS.64 _, [_+_]"


def test_renamed_registers_move_nothing_and_a_reordered_loop_counts_its_moves():
    renamed = [line.replace("R3", "R11").replace("UR16", "UR12") for line in LOOP]
    assert sass.moved(sass.main_loop(_text(LOOP)), sass.main_loop(_text(renamed))) == 0
    swapped = LOOP[:2] + [LOOP[3], LOOP[2]] + LOOP[4:]  # the exp2 after the FMA
    assert sass.moved(sass.main_loop(_text(LOOP)), sass.main_loop(_text(swapped))) == 2


def test_a_kernel_without_wgmma_has_no_main_loop():
    assert sass.main_loop(_text(["S2R R0, SR_TID.X", "EXIT"])) == []


def test_the_cli_names_what_sass_and_compare_need(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        cli.main(["--dump", str(tmp_path), "--compare", str(tmp_path)])
    assert "--compare needs --sass" in capsys.readouterr().err
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit):
        cli.main(["--dump", str(tmp_path), "--sass"])
    assert "--sass needs nvdisasm" in capsys.readouterr().err
