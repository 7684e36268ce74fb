"""Early-exit self-speculative drafting: the first N layers, then the final norm and LM head.

As in LayerSkip (Elhoushi et al. 2024, "LayerSkip: Enabling Early Exit Inference
and Self-Speculative Decoding", arXiv 2404.16710) and transformers'
``EarlyExitCandidateGenerator``, the draft is the target model cut after layer
N - 1; its own final norm and LM head turn the hidden state into logits.

It is a layer-skip drafter whose skip set is every sublayer of layers N .. L-1:
those layers are bypassed whole (``layer_skip.draft_mode``), so the stock forward
still applies the final norm and head; see ``LayerSkipDrafter``.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from specdecode.drafters.layer_skip import LayerSkipDrafter, SkipSet, decoder_layers
from specdecode.errors import InvalidArgumentError


def exit_skip_set(exit_layer: int, num_layers: int) -> SkipSet:
    """The skip set of an exit after ``exit_layer`` layers: all sublayers of layers exit_layer..L-1.

    Raises:
        InvalidArgumentError: If ``exit_layer`` is not an integer in 1..num_layers-1.
    """
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer <= num_layers - 1:
        raise InvalidArgumentError(
            f"exit layer {exit_layer!r} is out of range: the model has {num_layers} decoder layers, "
            f"so the draft must keep 1..{num_layers - 1} of them"
        )
    rest = tuple(range(exit_layer, num_layers))
    return SkipSet(attn=rest, mlp=rest)


class EarlyExitDrafter(LayerSkipDrafter):
    """The target's first ``exit_layer`` decoder layers, final norm and LM head draft for every row.

    Args:
        model: The target model (the one the engine verifies with), in eval mode.
        exit_layer: N, how many leading decoder layers the draft runs, 1 <= N <= L - 1.

    Raises:
        InvalidArgumentError: If ``exit_layer`` is outside 1..L-1.
        UnsupportedModelError: If the decoder layers cannot be found.
    """

    who = "early-exit draft"

    def __init__(self, model: PreTrainedModel, exit_layer: int) -> None:
        super().__init__(model, exit_skip_set(exit_layer, len(decoder_layers(model))))
        self.exit_layer = exit_layer


def check_exit_layer_given(exit_layer: int | None) -> None:
    """Raise unless method "early-exit" got an exit layer (its range is checked by ``EarlyExitDrafter``).

    Raises:
        InvalidArgumentError: ``exit_layer`` is None.
    """
    if exit_layer is None:
        raise InvalidArgumentError(
            "method 'early-exit' needs exit_layer=N (--exit-layer N): the draft runs the target's "
            "first N decoder layers, 1 <= N <= L-1"
        )
