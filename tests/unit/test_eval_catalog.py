"""The catalog of the field's evaluation sets: every set found in its published layout (tests/rs_sets.py
writes each one with its release folder names and tiny images), under its folder-name variants or
none, the prompt phrase of each class, the published split lists applied, overrides, unknown sets
with their warnings, the published numbers with their sources, and the generated reference page."""

from __future__ import annotations

import configparser
import json
import shutil
from fnmatch import fnmatch
from pathlib import Path

import pytest

from tests.rs_sets import CAPTIONS, LAYOUTS, image_bytes, write_set, write_suite
from rsclip_ds.config import ConfigError
from rsclip_ds.evaluation.catalog import catalog, find_sets, folder_key, published_results
from rsclip_ds.evaluation.catalog_page import COMMAND, PAGE, render

ROOT = Path(__file__).resolve().parents[2]


def _by_name(found):
    return {f.name: f for f in found}


def _phrases(found_set) -> dict[str, str]:
    cfs = found_set.classification
    return dict(zip(cfs.folders, cfs.class_names))


def test_a_suite_root_holding_every_set(tmp_path):
    tops = write_suite(tmp_path, per_class=1)
    (tmp_path / "my_notes").mkdir()
    (tmp_path / "my_notes" / "readme.txt").write_text("not a set")        # no images: not listed
    (tmp_path / "loose" / "scans").mkdir(parents=True)
    (tmp_path / "loose" / "scans" / "a.jpg").write_bytes(image_bytes(1))  # images, but no class folders
    found, unrecognised = find_sets(tmp_path)
    sets = _by_name(found)
    assert sorted(sets) == sorted(s.name for s in catalog()) == sorted([*LAYOUTS, *CAPTIONS])
    assert unrecognised == [tmp_path / "loose"]
    for name, found_set in sets.items():   # each one in its own folder (nested image folders are the set's)
        assert found_set.root in (tops[name], *tops[name].rglob("*")), name
        assert found_set.spec.name == name and not found_set.warnings, (name, found_set.warnings)
    for name in ("RSI-CB128", "RSI-CB256", "NWPU-RESISC45", "OPTIMAL-31", "AID", "WHU-RS19"):   # overlapping classes
        assert len(sets[name].classification.folders) == len(sets[name].spec.classes), name
    assert sets["UCMerced"].root == tops["UCMerced"] / "Images"
    assert sets["MLRSNet"].root == tops["MLRSNet"] / "Images"          # Labels/ (CSVs only) is not a set
    assert sets["RSI-CB256"].notes == ["RSI-CB256: scored at the finest level that has images, the folder "
                                       "holding each image: 35 classes (35 at level 2 below RSI-CB256/)"]
    assert sets["MillionAID"].split == "all images of train/ (51; no test/ folder with class folders)"
    assert "51 classes (37 at level 3, 14 at level 2 below train/)" in sets["MillionAID"].notes[0]
    assert sets["RSICD"].split == "test (the 'split' field of dataset_rsicd.json: 1 images, 2 captions)"
    assert sets["RSICD"].retrieval.image_paths[0].parent.name == "RSICD_images"
    assert {sets["UCM-captions"].root.name, sets["Sydney-captions"].root.name} == {"UCM_captions", "Sydney_captions"}
    assert sets["AID"].split == "all images (no published test split)"


@pytest.mark.parametrize("name, folder", [
    ("NWPU-RESISC45", "NWPU_RESISC45"), ("NWPU-RESISC45", "RESISC45"), ("EuroSAT", "EuroSAT_RGB"),
    ("UCMerced", "UCM"), ("WHU-RS19", "RS19"), ("RSI-CB256", "my_copy"),      # no known name: its classes tell
    ("RSI-CB128", "rsicb"), ("OPTIMAL-31", "Optimal31"), ("PatternNet", "PatternNet"),
])
def test_one_sets_folder_under_its_name_variants(tmp_path, name, folder):
    top = write_set(name, tmp_path, per_class=1, folder=folder)
    for root in (tmp_path, top):   # the suite root holding it, or the set's own folder
        found, unrecognised = find_sets(root)
        assert [f.name for f in found] == [name] and unrecognised == []
        assert found[0].root in (top, *top.rglob("*"))


def test_a_set_named_like_a_catalog_set_needs_only_half_its_classes(tmp_path):
    top = write_set("AID", tmp_path, per_class=1)
    for extra in sorted(top.iterdir())[:12]:            # 18 of the 30 classes left: 60 %
        shutil.rmtree(extra)
    found, _ = find_sets(tmp_path)
    assert found[0].name == "AID" and len(found[0].classification.folders) == 18
    assert "12 of its 30 classes are not under" in found[0].warnings[0]
    top.rename(tmp_path / "scenes")                    # under another name 60 % is not AID
    found, _ = find_sets(tmp_path)
    assert found[0].name == "scenes" and found[0].spec is None


def test_phrases_of_release_folders_that_are_not_phrases(tmp_path):
    write_suite(tmp_path, ["RSSCN7", "UCMerced", "MLRSNet", "WHU-RS19", "PatternNet", "EuroSAT", "AID"])
    sets = _by_name(find_sets(tmp_path)[0])
    rsscn7 = _phrases(sets["RSSCN7"])    # a letter prefix for ordering
    assert rsscn7 == {"aGrass": "grassland", "bField": "farmland", "cIndustry": "industrial region",
                      "dRiverLake": "river and lake", "eForest": "forest", "fResident": "residential region",
                      "gParking": "parking lot"}
    ucm = _phrases(sets["UCMerced"])     # lower-case words run together
    assert (ucm["baseballdiamond"], ucm["storagetanks"], ucm["mobilehomepark"], ucm["agricultural"]) == (
        "baseball diamond", "storage tanks", "mobile home park", "agricultural")
    mlrs = _phrases(sets["MLRSNet"])     # the release's own spellings
    assert (mlrs["swimmimg_pool"], mlrs["harbor&port"], mlrs["bareland"]) == ("swimming pool", "harbor and port",
                                                                             "bare land")
    assert _phrases(sets["WHU-RS19"])["footballField"] == "football field"
    assert _phrases(sets["PatternNet"])["wastewater_treatment_plant"] == "wastewater treatment plant"
    assert _phrases(sets["EuroSAT"])["SeaLake"] == "sea or lake"
    assert _phrases(sets["AID"])["BareLand"] == "bare land"


def test_published_split_lists_beside_the_data(tmp_path):
    top = write_set("UCMerced", tmp_path, per_class=3)
    found = find_sets(tmp_path)[0][0]
    assert found.split == "test (published split list uc_merced-test.txt: 21 of 63 images)"
    assert len(found.classification.paths) == 21 and {p.name[-6:] for p in found.classification.paths} == {"02.tif"}
    assert sorted(set(found.classification.labels)) == list(range(21))
    (tmp_path / "uc_merced-test.txt").unlink()
    found = find_sets(top)[0][0]
    assert found.split == "all images (the published test split uc_merced-test.txt is not beside the data)"
    assert len(found.classification.paths) == 63
    euro = write_set("EuroSAT", tmp_path / "e", per_class=2)    # the list names .jpg; the all-bands .tif match by stem
    for image in euro.rglob("*.jpg"):
        image.rename(image.with_suffix(".tif"))
    found = find_sets(euro)[0][0]
    assert found.split == "test (published split list eurosat-test.txt: 10 of 20 images)"
    assert "13-band GeoTIFFs" in found.warnings[0]


def test_a_sets_own_test_folder(tmp_path):
    top = write_set("MillionAID", tmp_path, per_class=2)
    shutil.copytree(top / "train", top / "test")
    found = find_sets(tmp_path)[0]
    assert [f.name for f in found] == ["MillionAID"] and found[0].root == top
    assert found[0].split == "test (the set's own test/ folder: 102 images)"
    assert all("test" in p.parts for p in found[0].classification.paths)


def test_overrides_win_over_the_catalog(tmp_path):
    write_set("RSSCN7", tmp_path, per_class=1)
    overrides = tmp_path.parent / f"{tmp_path.name}_names.json"
    overrides.write_text(json.dumps({"rsscn7": {"aGrass": "meadow", "g_parking": "car park"}}))
    phrases = _phrases(find_sets(tmp_path, overrides)[0][0])
    assert (phrases["aGrass"], phrases["gParking"], phrases["bField"]) == ("meadow", "car park", "farmland")
    overrides.write_text(json.dumps({"RSSCN7": {"hWater": "water"}}))
    with pytest.raises(ConfigError, match=r"name folders it does not have: \['hwater'\].*aGrass, bField"):
        find_sets(tmp_path, overrides)
    overrides.write_text(json.dumps({"RSSCN7x": {"aGrass": "meadow"}, "AID": {"Airport": "airfield"}}))
    with pytest.raises(ConfigError, match=r"overrides name no set: \['RSSCN7x'\]; the sets under .*: RSSCN7 "):
        find_sets(tmp_path, overrides)    # AID: a catalog set that is not here, not an error
    overrides.write_text(json.dumps({"RSSCN7": ["grass"]}))
    with pytest.raises(ConfigError, match='expected {"<set name>": {"<class folder>": "<prompt phrase>"}}'):
        find_sets(tmp_path, overrides)


def test_an_unknown_class_folder_set(tmp_path):
    for folder in ("denseForest", "oiltank", "xqzzy_site", "tennis_court"):
        (tmp_path / "my_scenes" / folder).mkdir(parents=True)
        (tmp_path / "my_scenes" / folder / "1.png").write_bytes(image_bytes(len(folder), ".png"))
    found, unrecognised = find_sets(tmp_path)
    assert len(found) == 1 and unrecognised == []
    scenes = found[0]
    assert (scenes.name, scenes.spec, scenes.split) == ("my_scenes", None,
                                                       "all images (not a catalog set: no published split)")
    assert _phrases(scenes) == {"denseForest": "dense forest", "oiltank": "oil tank", "xqzzy_site": "xqzzy site",
                                "tennis_court": "tennis court"}
    assert scenes.warnings == [
        "my_scenes/oiltank: run-together words split ('oiltank' -> 'oil tank'), prompted as 'oil tank'; name the "
        'class in an overrides JSON {"my_scenes": {"oiltank": "<phrase>"}} if the prompt is wrong',
        "my_scenes/xqzzy_site: 'xqzzy' is not a known word, so the class is prompted as 'xqzzy site'; name the "
        'class in an overrides JSON {"my_scenes": {"xqzzy_site": "<phrase>"}} if the prompt is wrong']


def test_sydney_and_ucm_captions_told_apart_by_image_count(tmp_path):
    folder = tmp_path / "captions"
    (folder / "imgs").mkdir(parents=True)
    (folder / "imgs" / "2.tif").write_bytes(image_bytes(2, ".tif"))
    images = [{"filename": f"{i}.tif", "split": "test" if i == 2 else "train", "sentences": [{"raw": f"c {i}"}]}
              for i in range(1, 614)]
    (folder / "dataset.json").write_text(json.dumps({"images": images}))
    found, _ = find_sets(tmp_path)
    assert [f.name for f in found] == ["Sydney-captions"] and found[0].retrieval.captions == ["c 2"]


def test_published_results_and_their_sources():
    results = published_results()
    git = {r.set: r.value for r in published_results() if r.model == "Git-RSCLIP"}
    assert git == {"OPTIMAL-31": 0.95, "RSC11": 0.67, "RSI-CB128": 0.52, "WHU-RS19": 0.94, "RSSCN7": 0.64,
                   "CLRS": 0.65}
    assert {r.model for r in published_results("WHU-RS19")} == {"CLIP", "RemoteCLIP", "GeoRSCLIP", "SkyCLIP50",
                                                                 "Git-RSCLIP"}
    recall = {(r.model, r.set): (r.value, r.verified) for r in results if r.metric == "mean_recall"}
    assert recall[("GeoRSCLIP-FT", "RSITMD")] == (51.81, True) and recall[("GeoRSCLIP-FT", "RSICD")] == (38.87, True)
    assert recall[("RemoteCLIP ViT-L-14", "RSITMD")] == (50.52, False)
    assert all(r.source.startswith("https://") and (r.verified or r.note) for r in results)
    assert {r.set for r in results} <= {s.name for s in catalog()}


def test_every_data_file_is_a_usable_set():
    for spec in catalog():
        assert spec.task in ("classification", "retrieval") and spec.source.startswith("https://"), spec.file
        assert spec.checked and spec.aliases and spec.protocol, spec.file
        if spec.task == "classification":
            assert len(spec.keys) == len(spec.classes) >= 7, spec.file   # no two folders alike once normalised
            assert all(p and p == p.strip().lower() for p in spec.classes.values()), spec.file
        else:
            assert spec.caption_json and spec.image_dirs and not spec.classes, spec.file
    assert folder_key("Bare Land") == folder_key("bare_land") == folder_key("BareLand") == "bareland"


def test_the_committed_reference_page_is_current():
    committed = (ROOT / PAGE).read_text()
    assert committed == render(), f"{PAGE} is out of date with the data files: regenerate it with `{COMMAND}`"
    for spec in catalog():
        assert f"### {spec.name}\n" in committed


def test_a_non_editable_install_carries_the_data_files():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    patterns = [p.strip() for p in cfg["options.package_data"]["rsclip_ds"].replace("\n", ",").split(",") if p.strip()]
    data = [p.relative_to(ROOT / "rsclip_ds").as_posix() for p in (ROOT / "rsclip_ds/evaluation/sets").iterdir()]
    assert data and all(any(fnmatch(d, pattern) for pattern in patterns) for d in data), (data, patterns)
