"""A run resumed from its newest complete checkpoint reproduces the uninterrupted loss curve."""
import shutil

from ringfa4.train import checkpoint, launch, trainer
from train_configs import SMALL, composed


def test_resume_from_latest_complete_checkpoint_reproduces_loss_curve(tmp_path):
    ckpt = tmp_path / "ckpt"
    overrides = SMALL + ["train.steps=6", f"train.checkpoint_dir={ckpt}", "train.checkpoint_interval=2",
                         "train.checkpoint_keep=0"]
    full = launch.spawn(trainer.train, 2, composed(*overrides))
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    assert checkpoint.complete_steps(ckpt) == [2, 4, 6]

    # Step 6's save "was killed": its folder is left partial (no marker); step 4 is the newest complete one.
    (ckpt / "step_00000006" / checkpoint.MARKER).unlink()
    shutil.move(ckpt / "step_00000006", ckpt / "step_00000006.partial")
    assert checkpoint.complete_steps(ckpt) == [2, 4]

    resumed = launch.spawn(trainer.train, 2, composed(*overrides, "train.resume=true"))
    assert sorted(resumed) == [5, 6]
    for step in (5, 6):
        assert abs(resumed[step] - full[step]) <= 1e-6 * abs(full[step]), (step, resumed[step], full[step])
    assert checkpoint.complete_steps(ckpt) == [2, 4, 6]
    assert not (ckpt / "step_00000006.partial").exists()
