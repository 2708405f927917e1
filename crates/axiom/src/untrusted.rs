//! Entry points that take arbitrary bytes, shared by the fuzz targets (`fuzz/`) and the test that
//! replays their corpora. Each must return, whatever the input: no panic, hang or huge allocation.

use crate::chat::{ChatTemplate, Message};
use crate::format::gguf::GgufFile;
use crate::format::safetensors::SafetensorsModel;
use crate::model::ModelConfig;
use crate::tokenizer::Tokenizer;

/// A GGUF file: the reader, then the config and tokenizer built from what it accepted.
pub fn gguf(data: &[u8]) {
    if let Ok(file) = GgufFile::from_bytes(data) {
        for t in &file.tensors {
            let _ = file.tensor_bytes(t).len();
        }
        let _ = ModelConfig::from_gguf(&file);
        if let Ok(tokenizer) = Tokenizer::from_gguf(&file) {
            // Round trip some text through what the file's vocabulary built.
            if let Ok(ids) = tokenizer.encode("Hello, world! 123 <|im_start|>", true, true) {
                let _ = tokenizer.decode(&ids, false);
            }
        }
    }
}

/// A safetensors file, and the same bytes as a config.json.
pub fn safetensors(data: &[u8]) {
    if let Ok(model) = SafetensorsModel::from_bytes(data) {
        for (_, entry) in model.names() {
            let _ = model.bytes(entry).len();
        }
    }
    if let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = ModelConfig::from_hf(&json);
    }
}

/// Text through a real vocabulary. Byte-level BPE treats every byte alone, so text made of
/// characters that each survive encode-then-decode must survive it whole. (SmolLM2's vocabulary
/// lacks tokens for some bytes, C0 controls and some UTF-8 lead bytes among them; characters with
/// such a byte are dropped or mangled by encoding, and are left out here.) Any ids too (the bytes
/// read as little-endian u32, wrapped into the vocabulary) decode and stream without failing. And
/// the text as a chat message's content is plain text: it adds no special tokens to the prompt.
pub fn tokenizer_round_trip(tokenizer: &Tokenizer, data: &[u8]) {
    let round_trip = |text: &str| {
        tokenizer
            .encode(text, false, false)
            .and_then(|ids| tokenizer.decode(&ids, false))
    };
    let text: String = String::from_utf8_lossy(data)
        .chars()
        .filter(|c| {
            let mut buf = [0u8; 4];
            let c = c.encode_utf8(&mut buf);
            round_trip(c).is_ok_and(|back| back == *c)
        })
        .collect();
    if let Ok(back) = round_trip(&text) {
        assert_eq!(back, text, "encode then decode changed the text");
    }
    let vocab = tokenizer.vocab_size().max(1) as u32;
    let ids: Vec<u32> = data
        .chunks(4)
        .map(|c| c.iter().rev().fold(0u32, |a, &b| a << 8 | b as u32) % vocab)
        .collect();
    let mut stream = crate::tokenizer::TextStream::default();
    for &id in &ids {
        let _ = stream.push(tokenizer, id);
    }
    let _ = tokenizer.decode(&ids, true);

    // As a chat message's content the text adds no special tokens to the template's own.
    let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                  <|im_start|>assistant\n";
    let Ok(template) = ChatTemplate::new(chatml, "", "") else {
        return;
    };
    let specials = |content: &str| -> Option<Vec<u32>> {
        let chat = template.render_chat(&[Message::new("user", content)], true).ok()?;
        let ids = tokenizer.encode_chat(&chat).ok()?;
        // Special tokens are those that decoding leaves out when asked to.
        let special = |id: u32| {
            tokenizer.decode(&[id], true).is_ok_and(|t| t.is_empty())
                && tokenizer.decode(&[id], false).is_ok_and(|t| !t.is_empty())
        };
        Some(ids.into_iter().filter(|&id| special(id)).collect())
    };
    let content = String::from_utf8_lossy(data);
    assert_eq!(
        specials(&content),
        specials(""),
        "message content became special tokens"
    );
}

/// A chat template and a message (split at the first NUL), rendered within the fuel limit and
/// the messages placed in the text.
pub fn chat_template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (template, message) = text.split_once('\u{0}').unwrap_or((&text, "hello"));
    if let Ok(t) = ChatTemplate::new(template, "<s>", "</s>") {
        let messages = [Message::new("system", message), Message::new("user", message)];
        let _ = t.render_chat(&messages, true);
    }
}
