//! `hbmalloc plan`: the memory budget of transformer training or inference
//! from a model description or a Hugging Face `config.json`, per device.
//!
//! The model counts what a step keeps alive: weights, gradients, optimizer
//! states and the optimizer's temporaries; activations saved for backward
//! per layer (Korthikanti et al., "Reducing Activation Recomputation in
//! Large Transformer Models": 16 values of the hidden size per token and
//! layer, 2 one-byte dropout masks, and with attention that materialises
//! its scores, 2.5 values per head and key); the logits and the loss's
//! log-softmax; for inference, the KV cache. The peak is the largest of
//! three moments: the end of the forward pass, the start of the backward
//! pass and the optimizer step.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde_json::Value;

use crate::human;

/// The most layers, hidden size, heads and key/value heads a model may have.
const MAX_DIMENSION: u64 = 1 << 20;
/// The most feed-forward size, vocabulary and positions (and any count a
/// `config.json` gives): with the other bounds, every product of the budget
/// fits in a `u128`.
const MAX_WIDTH: u64 = 1 << 32;
/// The largest ViT image side in pixels.
const MAX_IMAGE: u64 = 1 << 15;
/// The longest sequence.
const MAX_SEQ: u64 = 1 << 24;
/// The most samples per device.
const MAX_BATCH: u64 = 1 << 20;
/// The most data-parallel devices.
const MAX_DEVICES: u64 = 1 << 20;

/// Arguments of `hbmalloc plan`.
#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    /// A Hugging Face `config.json` (GPT-2, LLaMA/Mistral/Qwen, ViT, BERT
    /// style keys); the options below override what it says.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// A known model instead: gpt2, gpt2-medium, gpt2-large, gpt2-xl,
    /// vit-base-16, llama-2-7b.
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// Transformer layers.
    #[arg(long)]
    layers: Option<u64>,
    /// Hidden size (d_model).
    #[arg(long)]
    hidden: Option<u64>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<u64>,
    /// Key/value heads (grouped-query attention); default: heads.
    #[arg(long)]
    kv_heads: Option<u64>,
    /// Feed-forward size; default 4 x hidden.
    #[arg(long)]
    ffn: Option<u64>,
    /// Vocabulary size (0: no token embedding or LM head, as for ViT).
    #[arg(long)]
    vocab: Option<u64>,
    /// Learned position embeddings (0: none, as with rotary embeddings).
    #[arg(long)]
    positions: Option<u64>,
    /// A gated feed-forward (SwiGLU: three matrices instead of two).
    #[arg(long)]
    gated_mlp: bool,
    /// The feed-forward's activation is composed of elementwise operations
    /// that each keep a feed-forward-sized tensor for backward (GPT-2's
    /// `gelu_new`): three more per token and layer.
    #[arg(long)]
    composed_gelu: bool,
    /// The LM head has its own weights (not tied to the embedding).
    #[arg(long)]
    untied: bool,
    /// Sequence length (tokens per sample; for ViT, patches + 1).
    #[arg(long)]
    seq: Option<u64>,
    /// Samples per device per step (up to 2^20).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=MAX_BATCH))]
    batch: u64,
    /// Parameter dtype.
    #[arg(long, value_enum, default_value_t = Dtype::Fp32)]
    dtype: Dtype,
    /// Mixed precision (autocast): fp32 weights, gradients and optimizer
    /// states, 16-bit activations and a 16-bit copy of the weights.
    #[arg(long)]
    mixed_precision: bool,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = Optimizer::Adamw)]
    optimizer: Optimizer,
    /// Activation checkpointing: each layer keeps only its input, and one
    /// layer's activations are recomputed at a time.
    #[arg(long)]
    checkpointing: bool,
    /// Attention kernel: sdpa (flash or memory-efficient: no scores kept)
    /// or eager (scores, softmax and its dropout kept per head).
    #[arg(long, value_enum, default_value_t = Attention::Sdpa)]
    attention: Attention,
    /// Inference: no gradients or optimizer; a KV cache of --seq tokens.
    #[arg(long)]
    inference: bool,
    /// ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also
    /// weights, over --dp devices.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: u8,
    /// Data-parallel devices the ZeRO stage shards over (up to 2^20).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=MAX_DEVICES))]
    dp: u64,
    /// Print the budget as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Parameter or activation dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dtype {
    /// 4 bytes.
    Fp32,
    /// 2 bytes.
    Bf16,
    /// 2 bytes.
    Fp16,
}

impl Dtype {
    fn bytes(self) -> u64 {
        match self {
            Dtype::Fp32 => 4,
            Dtype::Bf16 | Dtype::Fp16 => 2,
        }
    }
}

/// Optimizer, by the states it keeps per parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Optimizer {
    /// Adam or AdamW: two states, and one parameter-sized temporary in its
    /// foreach step.
    Adamw,
    /// Adam (the same memory as AdamW).
    Adam,
    /// SGD with momentum: one state.
    SgdMomentum,
    /// Plain SGD: none.
    Sgd,
}

/// Attention kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Attention {
    /// Fused attention that keeps no scores.
    Sdpa,
    /// Attention that keeps its scores, softmax and dropout per head.
    Eager,
}

/// The shape of a transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Attention heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Feed-forward size.
    pub ffn: u64,
    /// Vocabulary (0: none).
    pub vocab: u64,
    /// Learned positions (0: none).
    pub positions: u64,
    /// SwiGLU feed-forward.
    pub gated_mlp: bool,
    /// The activation keeps three feed-forward-sized tensors of its own.
    pub composed_gelu: bool,
    /// LM head weights of its own.
    pub untied: bool,
    /// Linear layers and norms have biases (GPT-2, ViT, BERT: yes; LLaMA: no).
    pub bias: bool,
    /// Extra parameters outside the layers (ViT's patch embedding and head).
    pub extra_params: u64,
    /// The model's own sequence length, when it fixes one (ViT).
    pub seq: Option<u64>,
}

impl Model {
    /// Parameters (in `u128`: the product of the largest dimensions
    /// `model_of` accepts does not fit in 64 bits).
    pub fn params(&self) -> u128 {
        let [h, f, heads, kv_heads, vocab, positions, layers, extra] = [
            self.hidden,
            self.ffn,
            self.heads,
            self.kv_heads,
            self.vocab,
            self.positions,
            self.layers,
            self.extra_params,
        ]
        .map(u128::from);
        let kv = kv_heads * (h / heads.max(1));
        let b = u128::from(self.bias);
        let attention = h * (h + 2 * kv) + b * (h + 2 * kv) + h * h + b * h;
        let mlp = if self.gated_mlp {
            3 * h * f + b * (2 * f + h)
        } else {
            2 * h * f + b * (f + h)
        };
        let norms = 2 * (h + b * h);
        let layer = attention + mlp + norms;
        let embed = vocab * h + positions * h;
        let head = if self.untied { vocab * h } else { 0 };
        layers * layer + embed + head + (h + b * h) + extra
    }

    /// A known model by name.
    pub fn named(name: &str) -> Option<Model> {
        let gpt2 = |layers, hidden, heads| Model {
            layers,
            hidden,
            heads,
            kv_heads: heads,
            ffn: 4 * hidden,
            vocab: 50257,
            positions: 1024,
            gated_mlp: false,
            composed_gelu: true,
            untied: false,
            bias: true,
            extra_params: 0,
            seq: None,
        };
        Some(match name {
            "gpt2" => gpt2(12, 768, 12),
            "gpt2-medium" => gpt2(24, 1024, 16),
            "gpt2-large" => gpt2(36, 1280, 20),
            "gpt2-xl" => gpt2(48, 1600, 25),
            "vit-base-16" => vit(768, 12, 12, 3072, 224, 16, 1000),
            "llama-2-7b" => Model {
                layers: 32,
                hidden: 4096,
                heads: 32,
                kv_heads: 32,
                ffn: 11008,
                vocab: 32000,
                positions: 0,
                gated_mlp: true,
                composed_gelu: false,
                untied: true,
                bias: false,
                extra_params: 0,
                seq: None,
            },
            _ => return None,
        })
    }

    /// A model from a Hugging Face `config.json`.
    pub fn from_hf_config(config: &Value) -> Result<Model, String> {
        // Every count read is at most `MAX_WIDTH`, so that the sums below
        // cannot overflow; `model_of` bounds the model's dimensions further.
        let get = |keys: &[&str]| -> Result<Option<u64>, String> {
            match keys
                .iter()
                .find_map(|k| Some((*k, config.get(*k)?.as_u64()?)))
            {
                Some((key, value)) if value > MAX_WIDTH => {
                    Err(format!("{key} is {value}, more than 2^32"))
                }
                found => Ok(found.map(|(_, value)| value)),
            }
        };
        let kind = config
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        let need = |keys: &[&str]| {
            get(keys)?
                .ok_or_else(|| format!("config.json has none of the keys {}", keys.join(", ")))
        };
        let hidden = need(&["hidden_size", "n_embd", "d_model", "dim"])?;
        let heads = need(&["num_attention_heads", "n_head", "num_heads", "n_heads"])?;
        let layers = need(&["num_hidden_layers", "n_layer", "num_layers", "n_layers"])?;
        let ffn = get(&["intermediate_size", "n_inner", "d_ff", "ffn_dim"])?.unwrap_or(4 * hidden);
        if kind == "vit" {
            let image = get(&["image_size"])?.unwrap_or(224);
            let patch = get(&["patch_size"])?.unwrap_or(16);
            if hidden > MAX_DIMENSION || image > MAX_IMAGE || patch == 0 || patch > image {
                return Err(format!(
                    "a ViT of hidden size {hidden} (at most 2^20), image size {image} \
                     (at most 2^15) and patch size {patch} (1 to the image size)"
                ));
            }
            let labels = config
                .get("id2label")
                .and_then(Value::as_object)
                .map_or(2, |m| m.len() as u64);
            return Ok(vit(hidden, heads, layers, ffn, image, patch, labels));
        }
        let act = config
            .get("hidden_act")
            .or_else(|| config.get("activation_function"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let gated = act == "silu" || act == "swiglu" || kind.starts_with("llama");
        let rotary = config.get("rope_theta").is_some() || gated;
        Ok(Model {
            layers,
            hidden,
            heads,
            kv_heads: get(&["num_key_value_heads"])?.unwrap_or(heads),
            ffn,
            vocab: need(&["vocab_size"])?,
            positions: if rotary {
                0
            } else {
                get(&["n_positions", "max_position_embeddings"])?.unwrap_or(0)
            },
            gated_mlp: gated,
            composed_gelu: act == "gelu_new",
            untied: config
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .is_some_and(|tied| !tied),
            bias: !gated,
            extra_params: 0,
            seq: None,
        })
    }
}

/// ViT: patches of `patch` pixels of a 3-channel `image`, a class token,
/// learned positions, and a classifier of `labels` classes.
fn vit(
    hidden: u64,
    heads: u64,
    layers: u64,
    ffn: u64,
    image: u64,
    patch: u64,
    labels: u64,
) -> Model {
    let tokens = (image / patch).pow(2) + 1;
    Model {
        layers,
        hidden,
        heads,
        kv_heads: heads,
        ffn,
        vocab: 0,
        positions: tokens,
        gated_mlp: false,
        composed_gelu: false,
        untied: false,
        bias: true,
        extra_params: 3 * patch * patch * hidden + hidden + hidden + hidden * labels + labels,
        seq: Some(tokens),
    }
}

/// The budget of one device.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    /// Parameters of the model.
    pub params: u64,
    /// Weights held (with the 16-bit copy under mixed precision).
    pub weights_bytes: u64,
    /// Gradients.
    pub gradients_bytes: u64,
    /// Optimizer states.
    pub optimizer_bytes: u64,
    /// The optimizer step's temporaries.
    pub optimizer_temporaries_bytes: u64,
    /// Activations kept for backward, all layers.
    pub activations_bytes: u64,
    /// Logits, the loss's log-softmax and their gradient.
    pub logits_bytes: u64,
    /// KV cache (inference).
    pub kv_cache_bytes: u64,
    /// The end of the forward pass.
    pub forward_peak_bytes: u64,
    /// The start of the backward pass.
    pub backward_peak_bytes: u64,
    /// The optimizer step.
    pub optimizer_peak_bytes: u64,
    /// The largest of the three.
    pub peak_bytes: u64,
}

/// Computes the budget of one device, or says that a figure is over 2^64
/// bytes. The arithmetic is in `u128`: the bounds on the arguments, the
/// model (`model_of`) and the sequence (`run`) keep every product within it.
pub fn budget(model: &Model, args: &PlanArgs, seq: u64) -> Result<Budget, String> {
    let params = model.params();
    let [s, b, h, a, l, kv_heads, ffn, vocab, dp] = [
        seq,
        args.batch,
        model.hidden,
        model.heads,
        model.layers,
        model.kv_heads,
        model.ffn,
        model.vocab,
        args.dp,
    ]
    .map(u128::from);
    let p_bytes = if args.mixed_precision {
        4
    } else {
        u128::from(args.dtype.bytes())
    };
    let act = if args.mixed_precision {
        2
    } else {
        u128::from(args.dtype.bytes())
    };
    let shard = |bytes: u128, stage: u8| {
        if args.zero >= stage {
            bytes.div_ceil(dp)
        } else {
            bytes
        }
    };
    let layer_params = (params - vocab * h).div_ceil(l.max(1));
    // ZeRO-3 gathers one layer's weights at a time.
    let gathered = if args.zero >= 3 {
        layer_params * p_bytes
    } else {
        0
    };
    let cast_copy = if args.mixed_precision { params * 2 } else { 0 };
    let weights = shard(params * p_bytes, 3) + gathered + cast_copy;
    let states = match args.optimizer {
        Optimizer::Adamw | Optimizer::Adam => 2,
        Optimizer::SgdMomentum => 1,
        Optimizer::Sgd => 0,
    };
    let temporaries = u128::from(states == 2);
    let (gradients, optimizer, optimizer_temporaries) = if args.inference {
        (0, 0, 0)
    } else {
        (
            shard(params * p_bytes, 2),
            shard(states * params * p_bytes, 1),
            shard(temporaries * params * p_bytes, 1),
        )
    };
    // Per layer and token: 16 hidden-sized values and 2 one-byte masks;
    // eager attention adds scores, softmax and dropout per head and key.
    let composed = if model.composed_gelu { 3 } else { 0 };
    let per_layer = s * b * h * (16 * act + 2)
        + composed * s * b * ffn * act
        + match args.attention {
            Attention::Eager => a * s * s * b * (2 * act + 1),
            Attention::Sdpa => 0,
        };
    let activations = if args.inference {
        // Without autograd only the layer at work holds its values.
        per_layer
    } else if args.checkpointing {
        l * s * b * h * act + per_layer
    } else {
        l * per_layer
    };
    // Logits in the activation dtype, and the loss's fp32 log-softmax and
    // its gradient.
    let logits = s * b * vocab * (act + 4 + if args.inference { 0 } else { 4 });
    let kv_cache = if args.inference {
        2 * l * b * s * kv_heads * (h / a.max(1)) * act
    } else {
        0
    };
    let held = weights + optimizer;
    let forward_peak = held + activations + logits + kv_cache;
    let (backward_peak, optimizer_peak) = if args.inference {
        (0, 0)
    } else {
        // Backward starts with every activation, the logits' gradient and
        // the gradients of the (tied) embedding and LM head.
        let embedding_gradient = shard(vocab * h * p_bytes, 2);
        (
            held + activations + logits + embedding_gradient,
            held - cast_copy + gradients + optimizer_temporaries,
        )
    };
    let fit = |x: u128| {
        u64::try_from(x).map_err(|_| format!("the budget comes to {x} bytes, more than 2^64"))
    };
    Ok(Budget {
        params: fit(params)?,
        weights_bytes: fit(weights)?,
        gradients_bytes: fit(gradients)?,
        optimizer_bytes: fit(optimizer)?,
        optimizer_temporaries_bytes: fit(optimizer_temporaries)?,
        activations_bytes: fit(activations)?,
        logits_bytes: fit(logits)?,
        kv_cache_bytes: fit(kv_cache)?,
        forward_peak_bytes: fit(forward_peak)?,
        backward_peak_bytes: fit(backward_peak)?,
        optimizer_peak_bytes: fit(optimizer_peak)?,
        peak_bytes: fit(forward_peak.max(backward_peak).max(optimizer_peak))?,
    })
}

/// The model the arguments describe.
pub fn model_of(args: &PlanArgs) -> Result<Model, String> {
    let mut model = match (&args.config, &args.model) {
        (Some(_), Some(_)) => return Err("give --config or --model, not both".into()),
        (Some(path), None) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let value: Value = serde_json::from_str(&text)
                .map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
            Model::from_hf_config(&value).map_err(|e| format!("{}: {e}", path.display()))?
        }
        (None, Some(name)) => Model::named(name).ok_or_else(|| {
            format!(
                "unknown model '{name}': gpt2, gpt2-medium, gpt2-large, gpt2-xl, vit-base-16, \
                 llama-2-7b, or describe it (--layers, --hidden, --heads, --vocab)"
            )
        })?,
        (None, None) => {
            let need = |v: Option<u64>, what: &str| {
                v.ok_or_else(|| format!("--{what} is needed without --config or --model"))
            };
            let hidden = need(args.hidden, "hidden")?;
            let heads = need(args.heads, "heads")?;
            Model {
                layers: need(args.layers, "layers")?,
                hidden,
                heads,
                kv_heads: heads,
                // Saturating: `hidden` is checked below, with the flags.
                ffn: hidden.saturating_mul(4),
                vocab: need(args.vocab, "vocab")?,
                positions: 0,
                gated_mlp: false,
                composed_gelu: false,
                untied: false,
                bias: true,
                extra_params: 0,
                seq: None,
            }
        }
    };
    let set = |field: &mut u64, value: Option<u64>| {
        if let Some(v) = value {
            *field = v;
        }
    };
    set(&mut model.layers, args.layers);
    set(&mut model.hidden, args.hidden);
    set(&mut model.heads, args.heads);
    set(&mut model.kv_heads, args.kv_heads);
    set(&mut model.ffn, args.ffn);
    set(&mut model.vocab, args.vocab);
    set(&mut model.positions, args.positions);
    model.gated_mlp |= args.gated_mlp;
    model.composed_gelu |= args.composed_gelu;
    model.untied |= args.untied;
    for (value, what) in [
        (model.layers, "layers"),
        (model.hidden, "hidden"),
        (model.heads, "heads"),
        (model.kv_heads, "kv-heads"),
    ] {
        if value == 0 || value > MAX_DIMENSION {
            return Err(format!("--{what} must be between 1 and 2^20, not {value}"));
        }
    }
    for (value, what) in [
        (model.ffn, "ffn"),
        (model.vocab, "vocab"),
        (model.positions, "positions"),
    ] {
        if value > MAX_WIDTH {
            return Err(format!("--{what} must be at most 2^32, not {value}"));
        }
    }
    if model.hidden % model.heads != 0 || model.heads % model.kv_heads != 0 {
        return Err(format!(
            "{} heads must divide the hidden size {} and be a multiple of {} kv heads",
            model.heads, model.hidden, model.kv_heads
        ));
    }
    Ok(model)
}

/// Prints the budget.
pub fn run(args: PlanArgs) -> Result<(), String> {
    let model = model_of(&args)?;
    let seq = args
        .seq
        .or(model.seq)
        .ok_or("--seq is needed (tokens per sample)")?;
    if seq == 0 || seq > MAX_SEQ {
        return Err(format!("--seq must be between 1 and 2^24, not {seq}"));
    }
    if args.zero > 0 && args.dp == 1 {
        eprintln!("hbmalloc: --zero {} with --dp 1 shards nothing", args.zero);
    }
    if model.positions > 0 && seq > model.positions {
        eprintln!(
            "hbmalloc: --seq {seq} is past the model's {} learned positions: it cannot take \
             sequences that long (the budget is of the model as asked)",
            model.positions
        );
    }
    let budget = budget(&model, &args, seq)?;
    if args.json {
        outln!(
            "{}",
            serde_json::json!({
                "params": budget.params,
                "weights_bytes": budget.weights_bytes,
                "gradients_bytes": budget.gradients_bytes,
                "optimizer_bytes": budget.optimizer_bytes,
                "optimizer_temporaries_bytes": budget.optimizer_temporaries_bytes,
                "activations_bytes": budget.activations_bytes,
                "logits_bytes": budget.logits_bytes,
                "kv_cache_bytes": budget.kv_cache_bytes,
                "forward_peak_bytes": budget.forward_peak_bytes,
                "backward_peak_bytes": budget.backward_peak_bytes,
                "optimizer_peak_bytes": budget.optimizer_peak_bytes,
                "peak_bytes": budget.peak_bytes,
            })
        );
        return Ok(());
    }
    outln!(
        "{} parameters; {} layers, hidden {}, {} heads ({} kv), ffn {}, vocab {}; \
         batch {} x {seq} tokens",
        budget.params,
        model.layers,
        model.hidden,
        model.heads,
        model.kv_heads,
        model.ffn,
        model.vocab,
        args.batch
    );
    let rows = [
        ("weights", budget.weights_bytes),
        ("gradients", budget.gradients_bytes),
        ("optimizer states", budget.optimizer_bytes),
        ("optimizer temporaries", budget.optimizer_temporaries_bytes),
        ("activations", budget.activations_bytes),
        ("logits and loss", budget.logits_bytes),
        ("KV cache", budget.kv_cache_bytes),
    ];
    for (name, bytes) in rows.iter().filter(|r| r.1 > 0) {
        outln!("  {name:<24} {:>12}", human(*bytes));
    }
    outln!("peak per device, by moment:");
    outln!(
        "  {:<24} {:>12}",
        "end of forward",
        human(budget.forward_peak_bytes)
    );
    if !args.inference {
        outln!(
            "  {:<24} {:>12}",
            "start of backward",
            human(budget.backward_peak_bytes)
        );
        outln!(
            "  {:<24} {:>12}",
            "optimizer step",
            human(budget.optimizer_peak_bytes)
        );
    }
    outln!(
        "peak live                  {:>12}",
        human(budget.peak_bytes)
    );
    outln!(
        "live tensors only: add the allocator's waste (hbmalloc advise),\n\
         the CUDA context and library workspaces"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{budget, model_of, Model, PlanArgs};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    fn args(line: &[&str]) -> PlanArgs {
        let mut all = vec!["plan"];
        all.extend_from_slice(line);
        Cli::try_parse_from(all).unwrap().plan
    }

    #[test]
    fn parameter_counts_match_the_published_ones() {
        assert_eq!(Model::named("gpt2").unwrap().params(), 124_439_808);
        assert_eq!(Model::named("gpt2-medium").unwrap().params(), 354_823_168);
        assert_eq!(Model::named("gpt2-large").unwrap().params(), 774_030_080);
        assert_eq!(Model::named("gpt2-xl").unwrap().params(), 1_557_611_200);
        assert_eq!(Model::named("llama-2-7b").unwrap().params(), 6_738_415_616);
        // google/vit-base-patch16-224: 196 patches and a class token.
        let vit = Model::named("vit-base-16").unwrap();
        assert_eq!(
            (vit.params(), vit.seq, vit.positions),
            (86_567_656, Some(197), 197)
        );
    }

    #[test]
    fn a_described_model_takes_each_option() {
        let plain = model_of(&args(&[
            "--layers", "1", "--hidden", "4", "--heads", "2", "--vocab", "10",
        ]))
        .unwrap();
        assert_eq!((plain.ffn, plain.kv_heads, plain.positions), (16, 2, 0));
        assert!(plain.bias && !plain.gated_mlp && !plain.composed_gelu && !plain.untied);
        let line = [
            "--layers", "1", "--hidden", "4", "--heads", "2", "--vocab", "10", "--ffn", "8",
        ];
        let with = |extra: &[&str]| {
            let mut all = line.to_vec();
            all.extend_from_slice(extra);
            model_of(&args(&all)).unwrap()
        };
        // q, k, v, o: 4 x 16 weights and 4 x 4 biases; gate, up: 2 x (32 + 8);
        // down: 32 + 4; two norms: 2 x 8; the embedding 40; the final norm 8.
        assert_eq!(with(&["--gated-mlp"]).params(), 80 + 80 + 36 + 16 + 40 + 8);
        // Without the gate: one matrix and its bias fewer.
        assert_eq!(with(&[]).params(), 260 - 40);
        // An LM head of its own: vocab x hidden more.
        assert_eq!(with(&["--untied"]).params(), 220 + 40);
        assert!(with(&["--composed-gelu"]).composed_gelu);
        assert_eq!(with(&["--kv-heads", "1"]).params(), 220 - 2 * (8 + 2));
    }

    #[test]
    fn a_config_names_its_feed_forward_and_positions_by_its_keys() {
        let config = |extra: &str| {
            let text = format!(
                r#"{{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                    "vocab_size": 100, "max_position_embeddings": 512 {extra}}}"#
            );
            Model::from_hf_config(&serde_json::from_str(&text).unwrap())
        };
        for gated in [
            r#", "model_type": "mistral", "hidden_act": "silu""#,
            r#", "hidden_act": "swiglu""#,
            r#", "model_type": "llama""#,
        ] {
            let model = config(gated).unwrap();
            assert!(model.gated_mlp && !model.bias, "{gated}");
            assert_eq!(model.positions, 0, "rotary: {gated}");
        }
        let neox = config(r#", "hidden_act": "gelu", "rope_theta": 10000.0"#).unwrap();
        assert!(!neox.gated_mlp && neox.bias && !neox.untied);
        assert_eq!(neox.positions, 0);
        let learned =
            config(r#", "hidden_act": "gelu_new", "tie_word_embeddings": false"#).unwrap();
        assert!(learned.composed_gelu && learned.untied);
        assert_eq!(learned.positions, 512);
        let huge = config(r#", "intermediate_size": 4294967297"#).unwrap_err();
        assert!(huge.contains("intermediate_size is 4294967297"), "{huge}");
        let vit = |extra: &str| config(&format!(r#", "model_type": "vit" {extra}"#));
        assert_eq!(
            vit(r#", "image_size": 32, "patch_size": 8"#).unwrap().seq,
            Some(17)
        );
        assert_eq!(
            config(r#", "intermediate_size": 4294967296"#).unwrap().ffn,
            1 << 32
        );
        // The largest image in one patch, at the largest hidden size.
        let widest = r#", "image_size": 32768, "patch_size": 32768, "hidden_size": 1048576"#;
        assert_eq!(vit(widest).unwrap().seq, Some(2));
        for bad in [
            r#", "patch_size": 0"#,
            r#", "image_size": 8, "patch_size": 16"#,
            r#", "image_size": 32769"#,
            r#", "hidden_size": 1048577"#,
        ] {
            assert!(vit(bad).unwrap_err().contains("patch size"), "{bad}");
        }
    }

    #[test]
    fn a_model_out_of_bounds_is_refused_by_name() {
        let refused = |line: &[&str], needle: &str| {
            let mut all = vec!["--model", "gpt2"];
            all.extend_from_slice(line);
            let error = model_of(&args(&all)).unwrap_err();
            assert!(error.contains(needle), "{line:?}: {error}");
        };
        refused(&["--layers", "0"], "--layers");
        refused(&["--hidden", "1048577"], "--hidden");
        refused(&["--kv-heads", "0"], "--kv-heads");
        refused(&["--ffn", "4294967297"], "--ffn");
        refused(&["--vocab", "4294967297"], "--vocab");
        refused(&["--positions", "4294967297"], "--positions");
        // Heads (of hidden 768) that divide the hidden size but not by the kv
        // heads, and the other way round.
        refused(&["--heads", "8", "--kv-heads", "3"], "kv heads");
        refused(&["--heads", "7", "--kv-heads", "7"], "kv heads");
        // Without --model, a hidden size past 2^62 (whose default
        // feed-forward size, 4x, is past 2^64) is refused by name too.
        let error = model_of(&args(&[
            "--layers",
            "1",
            "--hidden",
            "18446744073709551615",
            "--heads",
            "1",
            "--vocab",
            "8",
        ]))
        .unwrap_err();
        assert!(error.contains("--hidden"), "{error}");
        assert!(model_of(&args(&[
            "--layers",
            "1",
            "--hidden",
            "1048576",
            "--heads",
            "1",
            "--vocab",
            "4294967296",
            "--ffn",
            "4294967296",
            "--positions",
            "4294967296"
        ]))
        .is_ok());
    }

    /// A 2-layer model, hidden 64, 4 heads, vocabulary 100, 16 tokens x 2
    /// samples, eager attention: 106,496 parameters (each layer 4 x 64^2 +
    /// 4 x 64 attention, 2 x 64 x 256 + 256 + 64 feed-forward, 256 norms;
    /// 6,400 embedding, 128 final norm).
    const SMALL: [&str; 14] = [
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--vocab",
        "100",
        "--seq",
        "16",
        "--batch",
        "2",
        "--attention",
        "eager",
    ];
    const SMALL_PARAMS: u64 = 106_496;

    fn small(extra: &[&str]) -> super::Budget {
        let mut all = SMALL.to_vec();
        all.extend_from_slice(extra);
        let a = args(&all);
        budget(&model_of(&a).unwrap(), &a, 16).unwrap()
    }

    #[test]
    fn each_part_of_a_training_budget_is_its_definition() {
        let p = SMALL_PARAMS;
        // fp16: Korthikanti et al.'s 34 sbh + 5 a s^2 b bytes per layer.
        let layer = 34 * 16 * 2 * 64 + 5 * 4 * 16 * 16 * 2;
        let half = small(&["--dtype", "fp16"]);
        assert_eq!(half.params, p);
        assert_eq!(
            [
                half.weights_bytes,
                half.gradients_bytes,
                half.optimizer_bytes
            ],
            [2 * p, 2 * p, 4 * p]
        );
        assert_eq!(half.optimizer_temporaries_bytes, 2 * p);
        assert_eq!(half.activations_bytes, 2 * layer);
        // fp16 logits, fp32 log-softmax and its gradient: 10 bytes a class.
        assert_eq!(half.logits_bytes, 16 * 2 * 100 * 10);
        let forward = 6 * p + 2 * layer + 32_000;
        assert_eq!(half.forward_peak_bytes, forward);
        // The embedding's gradient: 100 x 64 values of 2 bytes.
        assert_eq!(half.backward_peak_bytes, forward + 12_800);
        assert_eq!(half.optimizer_peak_bytes, 10 * p);
        assert_eq!(half.peak_bytes, 10 * p);
        assert_eq!(half.kv_cache_bytes, 0);

        // Checkpointing keeps each layer's 2-byte input and one layer.
        let ckpt = small(&["--dtype", "fp16", "--checkpointing"]);
        assert_eq!(ckpt.activations_bytes, 2 * 16 * 2 * 64 * 2 + layer);
        // A composed GELU keeps three more ffn-sized tensors a layer.
        let composed = small(&["--dtype", "fp16", "--composed-gelu"]);
        assert_eq!(
            composed.activations_bytes,
            2 * (layer + 3 * 16 * 2 * 256 * 2)
        );

        // Mixed precision: fp32 weights and a 16-bit copy, fp32 gradients,
        // states and temporaries, 16-bit activations.
        let mixed = small(&["--mixed-precision"]);
        assert_eq!(mixed.weights_bytes, 6 * p);
        assert_eq!(mixed.activations_bytes, 2 * layer);
        assert_eq!(mixed.forward_peak_bytes, 14 * p + 2 * layer + 32_000);
        assert_eq!(
            mixed.backward_peak_bytes,
            14 * p + 2 * layer + 32_000 + 25_600
        );
        assert_eq!(mixed.optimizer_peak_bytes, 20 * p);

        // ZeRO-3 over 4 devices, SGD with momentum, fp32: a quarter of the
        // weights, gradients and one state, and one layer's weights gathered.
        let zero = small(&["--zero", "3", "--dp", "4", "--optimizer", "sgd-momentum"]);
        let gathered = (p - 6_400).div_ceil(2) * 4;
        assert_eq!(zero.weights_bytes, p + gathered);
        assert_eq!([zero.gradients_bytes, zero.optimizer_bytes], [p, p]);
        assert_eq!(zero.optimizer_temporaries_bytes, 0);
        let fp32_layer = 16 * 2 * 64 * 66 + 4 * 16 * 16 * 2 * 9;
        assert_eq!(zero.activations_bytes, 2 * fp32_layer);
        assert_eq!(zero.logits_bytes, 16 * 2 * 100 * 12);
        let held = 2 * p + gathered;
        assert_eq!(
            zero.backward_peak_bytes,
            held + 2 * fp32_layer + 38_400 + 6_400
        );
        assert_eq!(zero.optimizer_peak_bytes, held + p);
        assert_eq!(small(&["--optimizer", "sgd"]).optimizer_bytes, 0);
    }

    #[test]
    fn inference_keeps_one_layer_and_a_kv_cache() {
        let b = small(&["--dtype", "bf16", "--inference", "--kv-heads", "2"]);
        // Two kv heads of 16 values: in each of the 2 layers, k and v lose
        // 64 x 32 weights and 32 biases each.
        let p = SMALL_PARAMS - 2 * (2 * 64 * 32 + 2 * 32);
        assert_eq!(b.params, p);
        let layer = 34 * 16 * 2 * 64 + 5 * 4 * 16 * 16 * 2;
        assert_eq!(b.activations_bytes, layer);
        assert_eq!(b.logits_bytes, 16 * 2 * 100 * 6);
        // K and V, 2 layers, 2 samples, 16 tokens, 2 heads of 16, 2 bytes.
        assert_eq!(b.kv_cache_bytes, 2 * 2 * 2 * 16 * 2 * 16 * 2);
        assert_eq!(b.forward_peak_bytes, 2 * p + layer + 19_200 + 8_192);
        assert_eq!([b.backward_peak_bytes, b.optimizer_peak_bytes], [0, 0]);
        assert_eq!(b.peak_bytes, b.forward_peak_bytes);
    }

    #[test]
    fn a_hugging_face_config_gives_the_same_model() {
        let gpt2: serde_json::Value = serde_json::from_str(
            r#"{"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                "vocab_size": 50257, "n_positions": 1024, "activation_function": "gelu_new"}"#,
        )
        .unwrap();
        assert_eq!(
            Model::from_hf_config(&gpt2).unwrap(),
            Model::named("gpt2").unwrap()
        );
        let llama: serde_json::Value = serde_json::from_str(
            r#"{"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
                "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
                "vocab_size": 32000, "hidden_act": "silu", "rope_theta": 10000.0,
                "tie_word_embeddings": false}"#,
        )
        .unwrap();
        assert_eq!(
            Model::from_hf_config(&llama).unwrap(),
            Model::named("llama-2-7b").unwrap()
        );
        // A fused GELU keeps only its input.
        let fused: serde_json::Value = serde_json::from_str(
            r#"{"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
                "activation_function": "gelu"}"#,
        )
        .unwrap();
        assert!(!Model::from_hf_config(&fused).unwrap().composed_gelu);
        let broken: serde_json::Value = serde_json::from_str(r#"{"n_layer": 2}"#).unwrap();
        assert!(Model::from_hf_config(&broken)
            .unwrap_err()
            .contains("hidden_size"));
    }

    #[test]
    fn adamw_training_holds_twenty_bytes_a_parameter_at_its_step() {
        let a = args(&["--model", "gpt2", "--seq", "8", "--batch", "1"]);
        let b = budget(&model_of(&a).unwrap(), &a, 8).unwrap();
        // Weights, gradients, two states and the step's temporary, 4 bytes each.
        assert_eq!(b.optimizer_peak_bytes, 20 * b.params);
        // ZeRO-2 over 4 devices shards states and gradients, not weights.
        let z = args(&["--model", "gpt2", "--seq", "8", "--zero", "2", "--dp", "4"]);
        let zb = budget(&model_of(&z).unwrap(), &z, 8).unwrap();
        assert_eq!(zb.weights_bytes, 4 * b.params);
        assert_eq!(zb.gradients_bytes, b.params);
        assert_eq!(zb.optimizer_bytes, 2 * b.params);
    }

    #[test]
    fn checkpointing_and_inference_keep_less() {
        let full = args(&["--model", "gpt2", "--seq", "1024", "--batch", "8"]);
        let ckpt = args(&[
            "--model",
            "gpt2",
            "--seq",
            "1024",
            "--batch",
            "8",
            "--checkpointing",
        ]);
        let model = model_of(&full).unwrap();
        let (f, c) = (
            budget(&model, &full, 1024).unwrap(),
            budget(&model, &ckpt, 1024).unwrap(),
        );
        assert!(c.activations_bytes * 4 < f.activations_bytes);
        let inf = args(&[
            "--model",
            "llama-2-7b",
            "--seq",
            "4096",
            "--dtype",
            "bf16",
            "--inference",
        ]);
        let b = budget(&model_of(&inf).unwrap(), &inf, 4096).unwrap();
        // 2 (K and V) x 32 layers x 4096 tokens x 4096 values x 2 bytes.
        assert_eq!(b.kv_cache_bytes, 2 * 32 * 4096 * 4096 * 2);
        assert_eq!(b.gradients_bytes + b.optimizer_bytes, 0);
    }
}
