def test_example_trains_checkpoints_and_resumes(digits_run):
    output_dir, first, second = digits_run
    assert "Total number of trainable weights: 9,866" in first
    assert "step 20: eval/acc" in first and "Resumed" not in first
    assert "Resumed from the checkpoint at step 20." in second
    assert "step 40: eval/acc" in second and "step 20:" not in second
    assert sorted(p.name for p in output_dir.iterdir() if p.name.isdigit()) == ["20", "40"]
    assert (output_dir / "lowest-eval-loss").is_dir()
    assert list(output_dir.glob("events.out.tfevents.*"))
