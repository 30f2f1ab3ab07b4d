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
    /// Samples per device per step.
    #[arg(long, default_value_t = 1)]
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
    /// Data-parallel devices the ZeRO stage shards over.
    #[arg(long, default_value_t = 1)]
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
    /// Parameters.
    pub fn params(&self) -> u64 {
        let (h, f) = (self.hidden, self.ffn);
        let head_dim = h / self.heads.max(1);
        let kv = self.kv_heads * head_dim;
        let b = u64::from(self.bias);
        let attention = h * (h + 2 * kv) + b * (h + 2 * kv) + h * h + b * h;
        let mlp = if self.gated_mlp {
            3 * h * f + b * (2 * f + h)
        } else {
            2 * h * f + b * (f + h)
        };
        let norms = 2 * (h + b * h);
        let layer = attention + mlp + norms;
        let embed = self.vocab * h + self.positions * h;
        let head = if self.untied { self.vocab * h } else { 0 };
        self.layers * layer + embed + head + (h + b * h) + self.extra_params
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
        let get = |keys: &[&str]| keys.iter().find_map(|k| config.get(*k)?.as_u64());
        let kind = config
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        let need = |keys: &[&str]| {
            get(keys).ok_or_else(|| format!("config.json has none of the keys {}", keys.join(", ")))
        };
        let hidden = need(&["hidden_size", "n_embd", "d_model", "dim"])?;
        let heads = need(&["num_attention_heads", "n_head", "num_heads", "n_heads"])?;
        let layers = need(&["num_hidden_layers", "n_layer", "num_layers", "n_layers"])?;
        let ffn = get(&["intermediate_size", "n_inner", "d_ff", "ffn_dim"]).unwrap_or(4 * hidden);
        if kind == "vit" {
            let image = get(&["image_size"]).unwrap_or(224);
            let patch = get(&["patch_size"]).unwrap_or(16);
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
            kv_heads: get(&["num_key_value_heads"]).unwrap_or(heads),
            ffn,
            vocab: need(&["vocab_size"])?,
            positions: if rotary {
                0
            } else {
                get(&["n_positions", "max_position_embeddings"]).unwrap_or(0)
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

/// Computes the budget of one device.
pub fn budget(model: &Model, args: &PlanArgs, seq: u64) -> Budget {
    let params = model.params();
    let (s, b, h, a, l) = (seq, args.batch, model.hidden, model.heads, model.layers);
    let p_bytes = if args.mixed_precision {
        4
    } else {
        args.dtype.bytes()
    };
    let act = if args.mixed_precision {
        2
    } else {
        args.dtype.bytes()
    };
    let dp = args.dp.max(1);
    let shard = |bytes: u64, stage: u8| {
        if args.zero >= stage {
            bytes.div_ceil(dp)
        } else {
            bytes
        }
    };
    let layer_params = (params - model.vocab * h).div_ceil(l.max(1));
    // ZeRO-3 gathers one layer's weights at a time.
    let gathered = if args.zero >= 3 {
        layer_params * p_bytes
    } else {
        0
    };
    let cast_copy = if args.mixed_precision { params * 2 } else { 0 };
    let weights_bytes = shard(params * p_bytes, 3) + gathered + cast_copy;
    let states = match args.optimizer {
        Optimizer::Adamw | Optimizer::Adam => 2,
        Optimizer::SgdMomentum => 1,
        Optimizer::Sgd => 0,
    };
    let temporaries = u64::from(states == 2);
    let (gradients_bytes, optimizer_bytes, optimizer_temporaries_bytes) = if args.inference {
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
        + composed * s * b * model.ffn * act
        + match args.attention {
            Attention::Eager => a * s * s * b * (2 * act + 1),
            Attention::Sdpa => 0,
        };
    let activations_bytes = if args.inference {
        // Without autograd only the layer at work holds its values.
        per_layer
    } else if args.checkpointing {
        l * s * b * h * act + per_layer
    } else {
        l * per_layer
    };
    // Logits in the activation dtype, and the loss's fp32 log-softmax and
    // its gradient.
    let classes = if model.vocab > 0 { model.vocab } else { 0 };
    let logits_bytes = s * b * classes * (act + 4 + if args.inference { 0 } else { 4 });
    let head_dim = h / a.max(1);
    let kv_cache_bytes = if args.inference {
        2 * l * b * s * model.kv_heads * head_dim * act
    } else {
        0
    };
    let held = weights_bytes + optimizer_bytes;
    let forward_peak_bytes = held + activations_bytes + logits_bytes + kv_cache_bytes;
    let (backward_peak_bytes, optimizer_peak_bytes) = if args.inference {
        (0, 0)
    } else {
        // Backward starts with every activation, the logits' gradient and
        // the gradients of the (tied) embedding and LM head.
        let embedding_gradient = shard(model.vocab * h * p_bytes, 2);
        (
            held + activations_bytes + logits_bytes + embedding_gradient,
            held - cast_copy + gradients_bytes + optimizer_temporaries_bytes,
        )
    };
    Budget {
        params,
        weights_bytes,
        gradients_bytes,
        optimizer_bytes,
        optimizer_temporaries_bytes,
        activations_bytes,
        logits_bytes,
        kv_cache_bytes,
        forward_peak_bytes,
        backward_peak_bytes,
        optimizer_peak_bytes,
        peak_bytes: forward_peak_bytes
            .max(backward_peak_bytes)
            .max(optimizer_peak_bytes),
    }
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
                ffn: 4 * hidden,
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
        if value == 0 || value > 1 << 20 {
            return Err(format!("--{what} must be between 1 and 2^20, not {value}"));
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
    if seq == 0 || args.batch == 0 || args.dp == 0 || seq > 1 << 24 || args.batch > 1 << 20 {
        return Err("--seq, --batch and --dp must be positive (seq up to 2^24, batch 2^20)".into());
    }
    if args.zero > 0 && args.dp == 1 {
        eprintln!("hbmalloc: --zero {} with --dp 1 shards nothing", args.zero);
    }
    let budget = budget(&model, &args, seq);
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
        assert_eq!(Model::named("llama-2-7b").unwrap().params(), 6_738_415_616);
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
        let b = budget(&model_of(&a).unwrap(), &a, 8);
        // Weights, gradients, two states and the step's temporary, 4 bytes each.
        assert_eq!(b.optimizer_peak_bytes, 20 * b.params);
        // ZeRO-2 over 4 devices shards states and gradients, not weights.
        let z = args(&["--model", "gpt2", "--seq", "8", "--zero", "2", "--dp", "4"]);
        let zb = budget(&model_of(&z).unwrap(), &z, 8);
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
        let (f, c) = (budget(&model, &full, 1024), budget(&model, &ckpt, 1024));
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
        let b = budget(&model_of(&inf).unwrap(), &inf, 4096);
        // 2 (K and V) x 32 layers x 4096 tokens x 4096 values x 2 bytes.
        assert_eq!(b.kv_cache_bytes, 2 * 32 * 4096 * 4096 * 2);
        assert_eq!(b.gradients_bytes + b.optimizer_bytes, 0);
    }
}
