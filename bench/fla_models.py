"""fla's models (fla 0.6, optional) behind flame's model interface, shaped like a flame model config, so
that flame's trainer and tools can run them in place of flame's: bench/train_step.py and
bench/generate.py build them through `fla_model_factory`."""

from __future__ import annotations


def fla_model_factory(family: str):
    """A factory of fla's model of `family`, shaped like flame's config, behind flame's model interface."""
    import torch
    from torch import nn

    def build(args):
        import fla.models as fm

        from flame.models import build_model

        with torch.device("meta"):
            flops_per_token = build_model(args).num_flops_per_token()

        common = dict(hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                      vocab_size=args.vocab_size, norm_eps=args.norm_eps,
                      tie_word_embeddings=args.tie_word_embeddings, fuse_cross_entropy=False)
        if family == "rwkv7":
            config = fm.RWKV7Config(head_dim=args.head_dim, use_l2warp=False, **common)
            model = fm.RWKV7ForCausalLM(config)
        elif family == "rwkv6":
            config = fm.RWKV6Config(num_heads=args.hidden_size // args.head_dim, expand_k=1.0,
                                    expand_v=1.0, **common)
            model = fm.RWKV6ForCausalLM(config)
        else:
            config = fm.GSAConfig(num_heads=args.num_heads, num_slots=args.num_slots,
                                  gate_logit_normalizer=args.gate_logit_normalizer, **common)
            model = fm.GSAForCausalLM(config)
        l2wrap = family in ("rwkv6", "rwkv7") and bool(args.l2wrap)  # as flame's RWKV models

        class FlaLM(nn.Module):
            """fla's model with flame's forward contract: logits, or the scaled CE sum given labels."""

            def __init__(self):
                super().__init__()
                self.inner = model
                self.layers = model.model.layers

            def forward(self, input_ids, cu_seqlens=None, labels=None, loss_scale=1.0):
                hidden = self.inner.model(input_ids=input_ids, cu_seqlens=cu_seqlens).last_hidden_state
                weight = self.inner.lm_head.weight
                if labels is None:
                    return hidden @ weight.t()
                from flame.ops.linear_cross_entropy import linear_cross_entropy
                return linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(),
                                            scale=loss_scale, l2wrap=l2wrap)

            @torch.no_grad()
            def init_weights(self):
                self.inner.apply(self.inner._init_weights)

            def num_flops_per_token(self):
                """flame's count for its model of the same config (docs/architecture.md, "FLOPs per
                token and MFU"): one formula for both libraries, so that their MFUs compare as their
                throughputs do."""
                return flops_per_token

        return FlaLM()

    return build
