//! The byte-level tokenizer: one token per UTF-8 byte, vocabulary 256.

/// Byte-level tokenizer (lossless for any text).
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Vocabulary size.
    pub const VOCAB_SIZE: usize = 256;

    /// Text to tokens.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Tokens to text; bytes that are not valid UTF-8 become U+FFFD, tokens
    /// above 255 (possible from a larger model vocabulary) are skipped.
    pub fn decode(&self, tokens: &[u32]) -> String {
        let bytes: Vec<u8> = tokens.iter().filter_map(|&t| u8::try_from(t).ok()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_unicode() {
        let t = ByteTokenizer;
        let s = "Call me Ishmael — ἀρχή";
        assert_eq!(t.decode(&t.encode(s)), s);
        assert_eq!(t.encode("A"), vec![65]);
    }
}
