// DPF's description of the flowjam plugin: an instrument (a generator) with stereo out and no MIDI input, so VST3
// hosts see only its own parameters (a DPF instrument with MIDI input adds 2,080 "MIDI CC" parameters first).
#pragma once

#define DISTRHO_PLUGIN_BRAND "flowjam"
#define DISTRHO_PLUGIN_NAME "flowjam"
#define DISTRHO_PLUGIN_URI "urn:flowjam:plugin"
#define DISTRHO_PLUGIN_CLAP_ID "org.flowjam.plugin"
#define DISTRHO_PLUGIN_BRAND_ID Fljm
#define DISTRHO_PLUGIN_UNIQUE_ID Fjam

#define DISTRHO_PLUGIN_HAS_UI 0
#define DISTRHO_PLUGIN_IS_RT_SAFE 1
#define DISTRHO_PLUGIN_IS_SYNTH 0
#define DISTRHO_PLUGIN_NUM_INPUTS 0
#define DISTRHO_PLUGIN_NUM_OUTPUTS 2
#define DISTRHO_PLUGIN_WANT_MIDI_INPUT 0
#define DISTRHO_PLUGIN_WANT_MIDI_OUTPUT 0
#define DISTRHO_PLUGIN_WANT_TIMEPOS 1
#define DISTRHO_PLUGIN_WANT_STATE 1
#define DISTRHO_PLUGIN_WANT_FULL_STATE 1
#define DISTRHO_PLUGIN_WANT_PARAMETER_VALUE_CHANGE_REQUEST 1  // the engine's own knob changes shown in the host
#define DISTRHO_PLUGIN_LV2_CATEGORY "lv2:GeneratorPlugin"
#define DISTRHO_PLUGIN_VST3_CATEGORIES "Instrument|Generator|Stereo"
#define DISTRHO_PLUGIN_CLAP_FEATURES "instrument", "stereo"
