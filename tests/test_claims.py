"""Every sentence of labs 06-08 that says what a recorded table shows is bound to a check on the recording
(tests/claims/labNN.py), and an edited recording breaks the claim it should."""

import importlib

import pytest

from claims import COMPARING, ROOT, Recordings, markdown_of, normalize, sentences

LABS = {"06": "06_fused_forward", "07": "07_training", "08": "08_step_time"}


def _module(lab):
    return importlib.import_module(f"claims.lab{lab}")


@pytest.fixture(scope="module")
def recordings():
    return Recordings()


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.parametrize("folder", ["solutions", "labs"])
def test_every_claim_is_in_the_lab_and_holds_on_the_recordings(lab, folder, recordings):
    text = normalize(markdown_of(ROOT / folder / f"{LABS[lab]}.ipynb"))
    module = _module(lab)
    missing = [c.phrase for c in module.CLAIMS if normalize(c.phrase) not in text]
    missing += [g for g in module.GENERAL if normalize(g) not in text]
    assert not missing, f"{folder}/{LABS[lab]}: phrases no longer in the lab (edit the claim with the text): {missing}"
    failing = [c.phrase for c in module.CLAIMS if not c.holds(recordings)]
    assert not failing, f"lab {lab}: sentences the recordings no longer bear out: {failing}"


@pytest.mark.parametrize("lab", LABS)
def test_an_edited_recording_breaks_the_claim_it_contradicts(lab, recordings):
    module = _module(lab)
    edited = recordings.copy()
    phrase = module.break_one(edited)
    claim = next(c for c in module.CLAIMS if c.phrase == phrase)
    assert claim.holds(recordings), "the claim must hold on the shipped recording first"
    assert not claim.holds(edited), f"lab {lab}: the edited recording should contradict {phrase!r}"


@pytest.mark.parametrize("lab", LABS)
def test_every_comparing_sentence_is_bound_or_general(lab):
    module = _module(lab)
    bound = [normalize(p) for p in [c.phrase for c in module.CLAIMS] + list(module.GENERAL)]
    loose = [s for s in sentences(markdown_of(ROOT / "solutions" / f"{LABS[lab]}.ipynb"))
             if COMPARING.search(s) and not any(p in s for p in bound)]
    assert not loose, (f"lab {lab}: sentences that compare figures but are bound to no claim; add a Claim to "
                       f"tests/claims/lab{lab}.py, print the sentence from the data, or list it as GENERAL: {loose}")
