"""kernel_templates (the declarative layer of the codegen): moving a formula there changed no
output bit. tools/kernel_outputs.py runs every templated kernel over fixed inputs (vector
tails, 16-bit storage, NaN, ±inf, ±0, subnormals) and hashes each output; the committed table
was recorded before the formulas moved."""
import json

from tools import kernel_outputs


def test_every_templated_kernel_output_is_bitwise_the_recorded_one():
    want = json.loads(kernel_outputs.GOLDEN.read_text())
    got = kernel_outputs.compute()
    assert sorted(got) == sorted(want), set(got) ^ set(want)
    changed = sorted(k for k in want if got[k] != want[k])
    assert not changed, f"{len(changed)} of {len(want)} cases changed: {changed[:10]}"
