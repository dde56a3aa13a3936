"""Every run recipe in configs/recipe/ composes over the package's defaults (through Hydra's
search path, as launch/ passes it) and resolves on the world size it is written for."""
import pytest

from ringfa4.train import config
from train_configs import RECIPES_DIR, composed

RECIPES = sorted(p.stem for p in (RECIPES_DIR / "recipe").glob("*.yaml"))


def test_the_recipes_named_in_the_readme_exist():
    assert {"llama3-8b-128k-node", "llama3-70b-256k-nvl72"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_resolves_on_its_world_size(recipe):
    # data.path is the one value a recipe leaves to the user.
    job = composed(f"hydra.searchpath=[file://{RECIPES_DIR}]", f"recipe={recipe}", "data.path=/data/train.bin")
    par = job.parallel
    assert par.cp > 0 and par.dp_shard > 0, "a recipe names its mesh, so that its world size is known"
    settings = config.resolve(job, par.cp * par.dp_shard, "cuda")
    assert settings.model == job.model.args() and job.model.name != "tiny"
    assert settings.param_dtype is not None  # bf16 on GPUs
