//! Turns simulator results into plots (PNG and SVG) and a summary page (filled in by the
//! reports issue; never imported by `pdkv-sim`).
