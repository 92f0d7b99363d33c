//! Feeds arbitrary bytes to the checkpoint / state-image decoder, which reads files from disk
//! and, later, state streamed from peers. It must return an error, never panic or hang, and a
//! state it accepts must encode back to bytes it accepts again as the same state.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_snapshot::StateImage;

fuzz_target!(|data: &[u8]| {
    if let Ok(img) = StateImage::decode(data) {
        let again = StateImage::decode(&img.encode().expect("a decoded image encodes")).expect("re-decodes");
        assert_eq!(again, img);
    }
});
