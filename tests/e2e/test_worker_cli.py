"""`strata-worker generate` and `strata-worker tokenize`, the engine's command line, on the real
default model: what a user (or a script) sees."""
import ast
import subprocess


def run(bin_dir, *args, timeout=300):
    return subprocess.run([bin_dir / "strata-worker", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def test_generate_answers_paris_in_chat_mode(bin_dir, default_model):
    out = run(bin_dir, "generate", "--model", default_model, "--chat",
              "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_generate_with_a_seed_is_reproducible(bin_dir, default_model):
    args = ["generate", "--model", default_model, "--prompt", "My favourite animal is",
            "--max-tokens", "8", "--temperature", "0.9", "--seed", "42"]
    a, b = run(bin_dir, *args), run(bin_dir, *args)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.strip()


def test_tokenize_prints_the_ids_digits_split_one_by_one(bin_dir, default_model):
    out = run(bin_dir, "tokenize", "--model", default_model, "Hello 2026")
    assert out.returncode == 0, out.stderr
    ids = ast.literal_eval(out.stdout.strip())
    # SmolLM2's pre-tokenizer puts every digit in its own token: "Hello", " ", "2", "0", "2", "6".
    assert len(ids) == 6, ids
    assert ids[2] == ids[4]


def test_a_bad_model_path_is_a_clear_error(bin_dir, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00 not really")
    out = run(bin_dir, "generate", "--model", bad, "--prompt", "hi")
    assert out.returncode != 0
    assert "broken.gguf" in out.stderr
    assert "panicked" not in out.stderr


def test_an_empty_prompt_is_refused(bin_dir, default_model):
    out = run(bin_dir, "generate", "--model", default_model, "--prompt", "")
    assert out.returncode != 0
    assert "empty" in out.stderr
    assert "panicked" not in out.stderr
