//! Chat messages and the model's own chat template (Jinja, rendered with
//! `minijinja` the way transformers' `apply_chat_template` renders it:
//! `trim_blocks` and `lstrip_blocks` on, `raise_exception` available, the
//! special tokens' strings in the context).
//!
//! [`ChatTemplate::assistant_spans`] finds what an assistant wrote in the
//! rendered text by rendering prefixes of the conversation, so it works for
//! any template whose output for a conversation starts with its output for
//! every shorter prefix (ChatML and the usual Llama / Qwen templates do).

use crate::error::DataError;
use serde::Serialize;
use std::ops::Range;

/// Who speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions that frame the conversation.
    System,
    /// The user.
    User,
    /// The model: the only role whose content is trained on.
    Assistant,
}

impl Role {
    /// `system`, `user` or `assistant`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "system" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            _ => None,
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// What they say.
    pub content: String,
}

impl Message {
    /// A message.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self { role, content: content.into() }
    }
}

/// A compiled chat template and the special-token strings it may use.
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`. `bos_token` / `eos_token` are the strings the
    /// template sees as `bos_token` / `eos_token` (empty when the tokenizer
    /// has none); `eos_token` also marks where an assistant turn ends.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, DataError> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(DataError::ChatTemplate)?;
        env.set_syntax(syntax);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(NAME, source.to_string()).map_err(DataError::ChatTemplate)?;
        Ok(Self { env, source: source.into(), bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The conversation as text; with `add_generation_prompt` followed by the
    /// header of an assistant turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, DataError> {
        let template = self.env.get_template(NAME).map_err(DataError::ChatTemplate)?;
        template
            .render(minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(DataError::ChatTemplate)
    }

    /// The rendered conversation and, per assistant message, the byte range
    /// of the text it contributes after its turn header: its content and the
    /// end-of-turn token (`eos_token`), not the separator after that. `Err`
    /// with the message index when a prefix of the conversation does not
    /// render to a prefix of the whole (the spans could not be trusted).
    pub fn assistant_spans(&self, messages: &[Message]) -> Result<(String, Vec<Range<usize>>), SpanError> {
        let full = self.render(messages, false).map_err(SpanError::Render)?;
        let mut spans = Vec::new();
        for (message_idx, m) in messages.iter().enumerate() {
            if m.role != Role::Assistant {
                continue;
            }
            let prompt = self.render(&messages[..message_idx], true).map_err(SpanError::Render)?;
            let upto = self.render(&messages[..=message_idx], false).map_err(SpanError::Render)?;
            if !upto.starts_with(&prompt) || !full.starts_with(&upto) {
                return Err(SpanError::NotPrefixStable { message_idx });
            }
            let turn = &upto[prompt.len()..];
            let end = match turn.rfind(self.eos_token.as_str()).filter(|_| !self.eos_token.is_empty()) {
                Some(at) => at + self.eos_token.len(),
                None => turn.trim_end().len(),
            };
            spans.push(prompt.len()..prompt.len() + end);
        }
        Ok((full, spans))
    }
}

/// Why assistant spans could not be found.
#[derive(Debug)]
pub enum SpanError {
    /// Rendering failed.
    Render(DataError),
    /// The template's output for the first `message_idx + 1` messages is not
    /// a prefix of its output for all of them.
    NotPrefixStable {
        /// The assistant message.
        message_idx: usize,
    },
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// SmolLM2-Instruct's template (ChatML with a default system prompt).
    pub(crate) const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_renders_and_spans_cover_content_and_end_of_turn() {
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let msgs = [
            Message::new(Role::User, "Hi"),
            Message::new(Role::Assistant, "Hello!"),
            Message::new(Role::User, "2+2?"),
            Message::new(Role::Assistant, "4"),
        ];
        let (text, spans) = t.assistant_spans(&msgs).unwrap();
        assert!(text.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
        assert!(text.ends_with("<|im_start|>assistant\n4<|im_end|>\n"));
        let got: Vec<&str> = spans.iter().map(|s| &text[s.clone()]).collect();
        assert_eq!(got, ["Hello!<|im_end|>", "4<|im_end|>"]);
        assert!(t
            .render(&msgs[..1], true)
            .unwrap()
            .ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
    }

    #[test]
    fn template_errors_are_named() {
        assert!(matches!(ChatTemplate::new("{% for %}", "", ""), Err(DataError::ChatTemplate(_))));
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        // a template that does not render prefixes as prefixes
        let t = ChatTemplate::new("{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}", "", "")
            .unwrap();
        let msgs = [Message::new(Role::User, "a"), Message::new(Role::Assistant, "b")];
        assert!(matches!(t.assistant_spans(&msgs), Err(SpanError::NotPrefixStable { message_idx: 1 })));
    }
}
